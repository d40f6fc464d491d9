"""A rank job for tests/plan/test_counting.py: what :class:`CollectiveCounter` sees of each way a collective is
issued (``torch.distributed`` calls, functional collectives, DDP's reducer in backward, FSDP2, DTensor's tensor
parallelism and its implicit redistributions, point-to-point), one counter per case, written to
``OUT_DIR/rank<N>.json`` as {case: {collective: bytes}} (received bytes under ``recv``)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from trainer_ext.plan.counting import CollectiveCounter


def _count(fn) -> dict[str, int]:
    counter = CollectiveCounter()
    with counter:
        fn()
    return counter.by_collective(include_recv=True)


def _c10d() -> None:
    dist.all_reduce(torch.ones(10))
    dist.all_gather_into_tensor(torch.empty(8), torch.ones(4))
    dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8))
    dist.broadcast(torch.ones(5), 0)
    dist.all_to_all_single(torch.empty(8), torch.ones(8))


def _p2p() -> None:
    if dist.get_rank() == 0:
        dist.send(torch.ones(6), 1)
    else:
        dist.recv(torch.empty(6), 0)


def _functional() -> None:
    group = dist.group.WORLD
    funcol.wait_tensor(funcol.all_reduce(torch.ones(6), "sum", group))
    funcol.wait_tensor(funcol.all_gather_tensor(torch.ones(4), 0, group))
    funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.ones(8), "sum", 0, group))


def _two_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))  # 272 + 68 = 340 parameters


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"c10d": _count(_c10d), "p2p": _count(_p2p), "functional": _count(_functional)}

    ddp = nn.parallel.DistributedDataParallel(_two_linears())
    for _ in range(2):  # the second iteration rebuilds the buckets (broadcasting their layout): not counted
        ddp(torch.randn(4, 16)).sum().backward()
    result["ddp"] = _count(lambda: ddp(torch.randn(4, 16)).sum().backward())

    from torch.distributed.fsdp import fully_shard

    fsdp = _two_linears()
    for module in (fsdp[0], fsdp[1], fsdp):
        fully_shard(module)
    fsdp(torch.randn(4, 16)).sum().backward()
    result["fsdp"] = _count(lambda: fsdp(torch.randn(4, 16)).sum().backward())

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    tp = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    parallelize_module(tp, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    inputs = torch.randn(4, 16, requires_grad=True)
    result["tp"] = _count(lambda: tp(inputs).sum().backward())

    left = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
    right = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
    result["implicit"] = _count(lambda: left @ right)  # DTensor gathers an operand inside its own dispatch

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
