"""The whole model of a pipeline-parallel job, put together from its stages: each stage's tensors gathered whole
(FSDP shards joined within the stage) and sent to rank 0, which writes ``model.safetensors`` (and its index) with the
config, loadable by ``from_pretrained`` on one process. Sharded checkpoints need nothing of this: every stage
saves its tensors under the full model's names (``torch.distributed.checkpoint``)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer_ext.checkpointing.saving import plan_shards, write_shards


def _full(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu").contiguous()


def gather_full_state(model: torch.nn.Module, same_batch_size: int) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0 (empty elsewhere); every rank calls it. The ranks of the first
    data-parallel group (global ranks below ``same_batch_size``) hold one copy of every stage and send it."""
    local = {name: _full(tensor) for name, tensor in model.state_dict().items()}  # FSDP gathers: all ranks
    rank = dist.get_rank()
    sent = local if rank < same_batch_size else {}
    received: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(sent, received, dst=0)
    if rank != 0:
        return {}
    state: dict[str, torch.Tensor] = {}
    for part in received or []:
        state.update(part)
    return state


def export(
    model: torch.nn.Module, directory: str | os.PathLike, same_batch_size: int, *, max_shard_size: str | int
) -> dict[str, int]:
    """Rank 0 writes the whole model as safetensors with its config and generation config; every rank calls it.
    Returns the counts of files and tensors written (zeros on other ranks)."""
    state = gather_full_state(model, same_batch_size)
    if dist.get_rank() != 0:
        return {"files": 0, "tensors": 0}
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    order = getattr(model, "_trainer_ext_full_shapes", None) or {}
    state = {k: state[k] for k in [*order, *state] if k in state}  # the full model's order
    plan = plan_shards(state, max_shard_size)
    out = write_shards(directory, plan, lambda names: {n: state[n] for n in names}, write=True)
    model.config.save_pretrained(out)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out)
    return {"files": len(plan.filename_to_tensors), "tensors": len(state)}
