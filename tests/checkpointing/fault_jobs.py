"""Damaged or mismatched sharded checkpoints on 2 gloo ranks (torchrun), checked by test_sharded_faults.py.

``python -m tests.checkpointing.fault_jobs OUT fsdp``: FSDP2 saves checkpoint-2 and checkpoint-4; the newest is
then damaged (a truncated shard, then a shard with the same size and changed bytes) and ``resolve_resume("auto")``
must pick checkpoint-2 on both ranks and say why; the run then resumes from it to the end. ``… OUT deepspeed``:
ZeRO-3 saves checkpoint-2; a run of another model must be refused. Each rank writes
``rank<R>.json`` to OUT.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import LlamaForCausalLM

from tests.helpers.jobs import StopAt, make_args
from tests.helpers.paths import CONFIGS
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.errors import ConfigError

SETTINGS = {
    "fsdp": {"fsdp": True},
    "deepspeed": {"deepspeed": str(CONFIGS / "deepspeed" / "zero3.json")},
}


class Lines(logging.Handler):
    """Keeps the resume warnings of this rank."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def trainer(out: Path, strategy: str, model=None, **overrides) -> Trainer:
    settings = {
        "save_strategy": "steps",
        "save_steps": 2,
        "max_steps": 6,
        "per_device_train_batch_size": 1,
        "save_on_preemption": True,
    }
    args = make_args(out, **{**settings, **SETTINGS[strategy], **overrides})
    return Trainer(model=model or tiny_llama(0), args=args, train_dataset=lm_dataset(24, seed=3))


def resume_choice(out: Path, strategy: str) -> dict:
    """What ``resolve_resume("auto")`` picks on this rank and the warnings it gives."""
    handler = Lines()
    logger = logging.getLogger("trainer_ext.trainer.checkpoints")
    logger.addHandler(handler)
    try:
        chosen = trainer(out, strategy).resolve_resume("auto")
    finally:
        logger.removeHandler(handler)
    return {"chosen": chosen and Path(chosen).name, "warnings": handler.lines}


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # the same size, bytes changed in the middle of the tensor data: only a checksum tells
        middle = len(data) // 2
        data[middle : middle + 16] = bytes(255 - b for b in data[middle : middle + 16])
        path.write_bytes(bytes(data))


def fsdp(out: Path, rank: int) -> dict:
    first = trainer(out, "fsdp")
    first.add_callback(StopAt(4))
    first.train()
    shard = out / "checkpoint-4" / "model_sharded" / "__1_0.distcp"
    pristine = shard.read_bytes()
    result = {}
    for how in ("truncate", "same_size"):
        if rank == 0:
            shard.write_bytes(pristine)
            damage(shard, how)
        dist.barrier()
        result[how] = resume_choice(out, "fsdp")
    resumed = trainer(out, "fsdp")
    resumed.train(resume_from_checkpoint="auto")  # from checkpoint-2 (checkpoint-4 is still damaged) to the end
    result["resumed_steps"] = resumed.state.global_step
    return result


def deepspeed(out: Path, rank: int) -> dict:
    trainer(out, "deepspeed", max_steps=2).train()
    config = tiny_llama(0).config
    config.intermediate_size = 80
    other = trainer(out, "deepspeed", model=LlamaForCausalLM(config))
    try:
        other.resolve_resume(str(out / "checkpoint-2"))
        return {"refused": None}
    except ConfigError as error:
        return {"refused": str(error)}


def main(out: str, mode: str) -> None:
    rank = int(os.environ["RANK"])
    result = {"fsdp": fsdp, "deepspeed": deepspeed}[mode](Path(out), rank)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:3])
