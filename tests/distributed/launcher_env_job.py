"""One rank started the way srun or mpirun start it (no torchrun): only SLURM_* / OMPI_* variables.

argv: OUT_DIR MODE — MODE ``ok`` checks the group and a collective; ``timeout`` has rank 1 skip a barrier,
so rank 0 must fail after ``ddp_timeout`` (3 s) instead of waiting half an hour.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer_ext import TrainingArguments

out_dir, mode = Path(sys.argv[1]), sys.argv[2]
args = TrainingArguments(output_dir=str(out_dir / "run"), use_cpu=True, ddp_timeout=3, report_to="none")
state = args.distributed_state
rank = dist.get_rank()
record = {
    "source": state.topology.source,
    "rank": rank,
    "local_rank": state.local_process_index,
    "world": dist.get_world_size(),
    "backend": dist.get_backend(),
    "parallel_mode": str(args.parallel_mode),
}
if mode == "ok":
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    record["sum"] = value.item()
    dist.barrier()
else:
    if rank == 1:
        time.sleep(8)  # alive past rank 0's timeout: its exit would end the barrier too, later
        sys.exit(0)
    start = time.monotonic()
    try:
        dist.barrier()
        record["error"] = None
    except Exception as exc:  # gloo raises when the timeout passes
        record["error"] = type(exc).__name__
    record["waited"] = time.monotonic() - start
(out_dir / f"rank{rank}.json").write_text(json.dumps(record))
