"""Rank job: a tiny Llama parallelized by ``parallelize`` on the mesh of each named ``ParallelismConfig``, against
the same model on the whole global batch in this process alone; writes the largest differences to OUT/rank<R>.json.

    python -m torch.distributed.run --nproc_per_node 4 -m tests.distributed.compose_job OUT float64 3 1,2,2 2,2,1

DTYPE and STEPS, then the configs (``dp_replicate,dp_shard,tp``). Each data-parallel rank trains on its slice of
the global batch (the ranks of one tp group on the same slice), its loss summed over its tokens and divided by the
global token count (times the data-parallel size, which FSDP's gradient average divides out again). Per step: the
loss, every gradient (``full_tensor()``), the total norm clipped by ``clip_grad_norm`` (max norm 0.5), then AdamW;
at the end the weights.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.distributed.tensor_parallel_job import MAX_NORM, _full, _max_diff, tiny_model
from trainer_ext.distributed.mesh.compose import parallelize
from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.distributed.mesh.device_mesh import build_parallel_mesh
from trainer_ext.distributed.mesh.grad_norm import clip_grad_norm

GLOBAL_BATCH = 4


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) of the global batch; uneven padding, so slices hold different token counts."""
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (GLOBAL_BATCH, 12))
    labels = ids.clone()
    for row, pad in enumerate((0, 3, 7, 1)):
        if pad:
            labels[row, -pad:] = -100
    return ids, labels


def layout(model: torch.nn.Module) -> dict:
    """How the model came out: FSDP units, the q_proj weight's mesh and placements, a norm weight's."""
    q = model.get_submodule("model.layers.0.self_attn.q_proj").weight
    norm = model.get_submodule("model.norm").weight

    def where(p: torch.Tensor) -> list:
        if not isinstance(p, DTensor):
            return []
        return [list(p.device_mesh.mesh_dim_names or ()), [str(x) for x in p.placements]]

    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    return {"fsdp_units": units, "q_proj": where(q), "norm": where(norm)}


def compare(spec: str, dtype: torch.dtype, steps: int) -> dict:
    replicate, shard, tp = (int(x) for x in spec.split(","))
    config = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp)
    built = build_parallel_mesh(config, "cpu")
    reference = tiny_model("llama", dtype)
    model = parallelize(copy.deepcopy(reference), built, config)
    seen: dict = {"layout": layout(model), "loss": 0.0, "grad": 0.0, "norm": 0.0, "clipped": 0.0}
    if not config.dp_shard_enabled and not config.tp_enabled:
        seen["unchanged"] = not any(isinstance(p, DTensor) for p in model.parameters())
        return seen
    ids, labels = global_batch()
    count = int((labels[:, 1:] != -100).sum())
    dp_size, dp_rank = config.data_parallel_size, built["dp"].get_local_rank()
    per_rank = GLOBAL_BATCH // dp_size
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        ref_loss = reference(input_ids=ids, labels=labels, num_items_in_batch=count).loss
        ref_loss.backward()
        local = _full(model(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=count).loss)
        (local * dp_size).backward()
        total = local.detach().clone()
        dist.all_reduce(total, group=built["dp"].get_group())
        seen["loss"] = max(seen["loss"], abs(total.item() - ref_loss.item()))
        seen["grad"] = max(
            seen["grad"],
            _max_diff({n: p.grad for n, p in model.named_parameters()}, dict(_grads(reference))),
        )
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        norm = clip_grad_norm(model.parameters(), MAX_NORM)
        seen["norm"] = max(seen["norm"], abs(norm.item() - ref_norm.item()))
        seen["ref_norm"] = ref_norm.item()
        clipped = {n: p.grad for n, p in model.named_parameters()}
        seen["clipped"] = max(seen["clipped"], _max_diff(clipped, dict(_grads(reference))))
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    seen["weights"] = _max_diff(dict(model.named_parameters()), dict(reference.named_parameters()))
    return seen


def _grads(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.grad) for n, p in model.named_parameters()]


def main(out: str, dtype: str, steps: str, *specs: str) -> None:
    dist.init_process_group("gloo")
    seen = {spec: compare(spec, getattr(torch, dtype), int(steps)) for spec in specs}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
