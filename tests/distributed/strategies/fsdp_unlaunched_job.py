"""FSDP2 in one process however it was started (plain ``python``, torchrun, ``trainer-ext launch``), for
test_fsdp_unlaunched.py.

``python -m tests.distributed.strategies.fsdp_unlaunched_job OUT loop``: an accelerate-style loop with
``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())``; ``… OUT trainer``: the Trainer with
``fsdp="full_shard"``. Writes the final weights (``weights.safetensors``) and ``facts.json`` to OUT.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext.checkpointing.sharded import full_state_dict

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _facts(model: torch.nn.Module, distributed_type: object) -> dict:
    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else None,
        "all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "distributed_type": str(getattr(distributed_type, "value", distributed_type)),
        "env": {name: os.environ.get(name) for name in LAUNCHER_VARS},
    }


def loop(out: Path) -> None:
    """The shape of accelerate's by-feature scripts: plugin, prepare, backward, step."""
    from trainer_ext import Accelerator, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    model = tiny_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = lm_dataset(16, seed=7).with_format("torch")
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    facts = {**_facts(model, accelerator.distributed_type), "losses": losses}
    weights = full_state_dict(accelerator.unwrap_model(model))
    _write(out, facts, weights)


def trainer(out: Path) -> None:
    """transformers' Trainer with ``fsdp="full_shard"`` and a sharded checkpoint."""
    from trainer_ext import Trainer

    args = make_args(out, fsdp="full_shard", max_steps=3, save_strategy="steps", save_steps=2)
    run = Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(16, seed=7))
    run.train()
    facts = _facts(run.model_wrapped, run.accelerator.distributed_type)
    facts["parallel_mode"] = str(args.parallel_mode.value)
    facts["losses"] = [entry["loss"] for entry in run.state.log_history if "loss" in entry]
    _write(out, facts, full_state_dict(run.accelerator.unwrap_model(run.model_wrapped)))


def _write(out: Path, facts: dict, weights: dict[str, torch.Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "weights.safetensors"))
    (out / "facts.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    {"loop": loop, "trainer": trainer}[sys.argv[2]](Path(sys.argv[1]))
