"""FSDP2 on one launched process (torchrun --nproc_per_node 1), compared by test_fsdp_one_process.py.

``python -m tests.distributed.strategies.fsdp_one_job OUT`` under torchrun with one process: the job without FSDP
first (no process group is made for it), then the same job under FSDP2 (a process group of world size 1, a 1-rank
mesh), an interrupted + resumed FSDP run, the consolidated export, and the Accelerator's loop with and without
``fsdp_config``. Writes the weights and ``results.json`` to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from transformers.training_args import ParallelMode

from tests.distributed.strategies.fsdp_jobs import FSDP, STEPS_DATA, STOP, gathered, train
from tests.helpers.jobs import StopAt, make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer

PROBE = [[5, 6, 7, 8, 9, 10]]
COMMON = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 1}


def grad_norms(trainer: Trainer) -> list[float]:
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def trainer_runs(out: Path, result: dict, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
    plain, result["losses_plain"] = train(out / "plain", {}, **COMMON)
    result["group_without_fsdp"] = dist.is_initialized()  # a launched process without FSDP makes no group
    result["grad_norms_plain"] = grad_norms(plain)
    tensors["plain"] = gathered(plain)
    del plain

    fsdp, result["losses_fsdp"] = train(out / "fsdp", FSDP, **COMMON)
    model = fsdp.model_wrapped
    result["grad_norms_fsdp"] = grad_norms(fsdp)
    result["parallel_mode_distributed"] = fsdp.args.parallel_mode == ParallelMode.DISTRIBUTED
    result["world_size"] = dist.get_world_size()
    result["mesh"] = list(fsdp.accelerator.strategy.mesh().shape)
    result["distributed_type"] = str(fsdp.accelerator.distributed_type.value)
    result["all_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
    tensors["fsdp"] = gathered(fsdp)
    fsdp.save_model(str(out / "export"))  # the final model: consolidated safetensors
    with torch.no_grad():
        result["logits"] = model(input_ids=torch.tensor(PROBE)).logits.tolist()
    del fsdp, model

    # interrupted at STOP (a sharded checkpoint of one rank) then resumed, against the uninterrupted run
    save = dict(save_strategy="steps", save_steps=STOP)
    full, _ = train(out / "resume_full", FSDP, **save)
    tensors["resume_full"] = gathered(full)
    args = dict(**FSDP, **save, per_device_train_batch_size=2, num_train_epochs=2)
    data = lm_dataset(STEPS_DATA, seed=7)
    part = Trainer(
        model=tiny_llama(0), args=make_args(out / "resume_part", **args), train_dataset=data, callbacks=[StopAt(STOP)]
    )
    part.train()
    again = Trainer(model=tiny_llama(0), args=make_args(out / "resume_part", **args), train_dataset=data)
    again.train(resume_from_checkpoint=str(out / "resume_part" / f"checkpoint-{STOP}"))
    tensors["resumed"] = gathered(again)
    result["resume_steps"] = [full.state.global_step, again.state.global_step]


def accelerator_runs(out: Path, result: dict, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
    """trainer_ext.Accelerator(fsdp_config=...) on the same process: the same loop with and without FSDP."""
    from tests.helpers.loops import train_loop

    config = FSDP["fsdp_config"]
    _, tensors["loop_plain"], _ = train_loop(per_device_batch=1, grad_accum=2)
    accelerator, tensors["loop_fsdp"], _ = train_loop(per_device_batch=1, grad_accum=2, fsdp_config=config)
    model = accelerator.engine._models[0]
    result["loop"] = {
        "distributed_type": str(accelerator.distributed_type.value),
        "num_processes": accelerator.num_processes,
        "use_distributed": accelerator.use_distributed,
        "all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
    }
    accelerator.save_model(model, out / "loop_export")
    kwargs = dict(per_device_batch=1, grad_accum=2, fsdp_config=config)
    train_loop(stop_after=8, save_to=out / "loop_state", **kwargs)
    _, tensors["loop_resumed"], _ = train_loop(resume_from=out / "loop_state", **kwargs)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    result: dict = {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    trainer_runs(target, result, tensors)
    accelerator_runs(target, result, tensors)
    for name, values in tensors.items():
        save_file({k: v.contiguous() for k, v in values.items()}, str(target / f"{name}.safetensors"))
    (target / "results.json").write_text(json.dumps(result, indent=1))
    print("done")
