"""What a rank sees of its launch (``python -m tests.helpers.launch_facts_job OUT [fail|hang|-] [ARG ...]``, on N ranks).

Each rank writes ``OUT/rankN.json``: torchrun's variables, trainer_ext's view of the topology, an all-reduce over
the gloo group. ``fail``: rank 1 raises after the group formed; ``hang``: rank 0 waits on a collective rank 1 never
joins. Used by tests/test_forked_ranks.py to hold the forked launch of the tests to torchrun's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer_ext.distributed.state import DistState

NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "OMP_NUM_THREADS",
)  # fmt: skip


def main(out: str, mode: str = "", *extra: str) -> None:
    state = DistState(cpu=True)
    state.join_process_group()  # one process: a group of its own, as under torchrun
    total = torch.ones(1)
    dist.all_reduce(total)
    rank = state.process_index
    facts = {
        "env": {name: os.environ.get(name) for name in NAMES},
        "has_port": bool(os.environ.get("MASTER_PORT")),
        "has_run_id": bool(os.environ.get("TORCHELASTIC_RUN_ID")),
        "state": [state.process_index, state.num_processes, state.local_process_index, str(state.distributed_type)],
        "sum": total.item(),
        "threads": torch.get_num_threads(),
        "cwd": os.getcwd(),
        "argv": sys.argv[1:],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(facts, sort_keys=True))
    print(f"rank {rank} done", flush=True)
    if mode == "fail" and rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    if mode == "hang" and rank == 0:
        time.sleep(600)  # never returns within the test's timeout


if __name__ == "__main__":
    main(*sys.argv[1:])
