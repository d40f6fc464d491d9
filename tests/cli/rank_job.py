"""A tiny job for launcher tests: rank information, an all-reduce and 5 data-parallel SGD steps.

``python rank_job.py OUT`` writes ``OUT/rank<r>.json`` per rank and ``OUT/weights.pt`` from rank 0.
The global batch is the same whatever the number of processes or machines, so the final weights are too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainer_ext.distributed.engine import Engine
from trainer_ext.distributed.state import DistState

VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "ACCELERATE_MIXED_PRECISION",
    "TRAINER_EXT_GRADIENT_ACCUMULATION_STEPS",
    "CUDA_VISIBLE_DEVICES",
)


def main(out: Path) -> None:
    state = DistState(cpu=True)
    rank, world = state.process_index, state.num_processes
    total = torch.tensor([rank + 1.0])
    if state.use_distributed:
        dist.all_reduce(total)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine = Engine(state)
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = torch.Generator().manual_seed(1)
    per_rank = 8 // world
    for _ in range(5):
        x, y = torch.randn(8, 8, generator=data), torch.randn(8, 1, generator=data)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        engine.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]))
        optimizer.step()
        optimizer.zero_grad()
    info = {name: os.environ.get(name) for name in VARIABLES}
    info.update(rank=rank, world_size=world, all_reduce=total.item())
    (out / f"rank{rank}.json").write_text(json.dumps(info))
    if rank == 0:
        torch.save(engine.unwrap_model(model).state_dict(), out / "weights.pt")
    state.destroy()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
