"""Rank job: a tiny Llama trained with AdamW on a mesh of all ranks, its sharded checkpoints written and loaded
across layouts; rank 0 writes each run's losses (``NAME.json``) and final weights (``NAME.safetensors``) to OUT.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.distributed.mesh_checkpoint_job OUT float64 tp

Tasks (after OUT and DTYPE):
- ``tp``: tensor parallel over all ranks: ``tp_reference`` (6 steps, saved to ``tp_ckpt`` after step 3), its export
  (``export/``, ``logits.pt`` of the in-memory model), ``tp_same`` (a fresh model resumed from ``tp_ckpt``, steps 4-6)
  and ``tp_model_only`` (the same with the optimizer left unloaded: the negative control);
- ``fsdp``: FSDP2 over all ranks resumed from ``tp_ckpt`` (``tp_to_fsdp``);
- ``from_one``: tensor parallel resumed from ``one_ckpt`` (written by one process: :func:`one_process`).

One process without a process group resumes ``tp_ckpt`` with ``resumed(OUT, "tp_to_one", "one", …)``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from tests.distributed.tensor_parallel_job import tiny_model
from trainer_ext.distributed.mesh.checkpoint import export_pretrained, full_state_dict, load_sharded, save_sharded
from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.distributed.mesh.device_mesh import build_parallel_mesh
from trainer_ext.distributed.mesh.tensor_parallel import apply_tensor_parallel

STEPS, SAVE_AT, VOCAB = 6, 3, 128


def batch(step: int) -> torch.Tensor:
    """The batch of optimizer step ``step``: the same on every rank and in every run."""
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 + step))


def probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))


def build(layout: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The seeded tiny Llama laid out as ``layout`` (``one``: one process; ``tp``; ``fsdp``) and its AdamW."""
    model = tiny_model("llama", dtype)
    if layout == "tp":
        mesh = build_parallel_mesh(ParallelismConfig(tp_size=dist.get_world_size()), "cpu")
        apply_tensor_parallel(model, mesh["tp"])
    elif layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    return losses


def record(out: Path, name: str, model: torch.nn.Module, losses: list[float]) -> None:
    """Rank 0 (or the one process) writes the losses and the whole weights; a collective for sharded models."""
    import json

    weights = full_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{name}.safetensors"))
        (out / f"{name}.json").write_text(json.dumps(losses))


def resumed(out: Path, name: str, layout: str, dtype: torch.dtype, ckpt: str, *, optimizer: bool = True) -> None:
    """A fresh model on ``layout`` loaded from ``out/ckpt`` (its optimizer too, unless told not), steps 4-6."""
    model, opt = build(layout, dtype)
    load_sharded(model, opt if optimizer else None, out / ckpt)
    record(out, name, model, train(model, opt, range(SAVE_AT, STEPS)))


def one_process(out: Path, dtype: torch.dtype) -> None:
    """One process, no process group: ``one_reference`` (6 steps, saved to ``one_ckpt`` after step 3)."""
    model, opt = build("one", dtype)
    losses = train(model, opt, range(SAVE_AT))
    save_sharded(model, opt, out / "one_ckpt")
    record(out, "one_reference", model, losses + train(model, opt, range(SAVE_AT, STEPS)))


def tp_task(out: Path, dtype: torch.dtype) -> None:
    model, opt = build("tp", dtype)
    losses = train(model, opt, range(SAVE_AT))
    save_sharded(model, opt, out / "tp_ckpt")
    losses += train(model, opt, range(SAVE_AT, STEPS))
    record(out, "tp_reference", model, losses)
    export_pretrained(model, out / "export")
    with torch.no_grad():
        logits = model(input_ids=probe()).logits
    if dist.get_rank() == 0:
        torch.save(logits.full_tensor() if isinstance(logits, DTensor) else logits, out / "logits.pt")
    resumed(out, "tp_same", "tp", dtype, "tp_ckpt")
    resumed(out, "tp_model_only", "tp", dtype, "tp_ckpt", optimizer=False)


def main(out: str, dtype: str, *tasks: str) -> None:
    dist.init_process_group("gloo")
    folder, torch_dtype = Path(out), getattr(torch, dtype)
    for task in tasks:
        if task == "tp":
            tp_task(folder, torch_dtype)
        elif task == "fsdp":
            resumed(folder, "tp_to_fsdp", "fsdp", torch_dtype, "tp_ckpt")
        elif task == "from_one":
            resumed(folder, "one_to_tp", "tp", torch_dtype, "one_ckpt")
        else:
            raise SystemExit(f"unknown task {task!r}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
