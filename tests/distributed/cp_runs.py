"""The launches of :mod:`tests.distributed.cp_job` that the context-parallel Trainer tests share: each runs once per
pytest session (four in all: one process, cp 2, cp 2 × dp_shard 2, cp 2 × tp 2) and its results are read by every
test that needs them."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.ranks import launch_once

JOB = "tests.distributed.cp_job"
# name -> (processes, cp,dp_shard,tp, tasks); "from=NAME" resumes launch NAME's checkpoint-5
LAUNCHES = {
    "cp2": (2, "2,1,1", ("train", "eval", "same_mesh", "packed", "unpacked")),
    "one": (1, "1,1,1", ("train", "eval", "from=cp2", "packed", "unpacked", "packed_args_cache", "packed_cache")),
    "cp_dp": (4, "2,2,1", ("train", "eval", "same_mesh", "from=one")),
    "cp_tp": (4, "2,1,2", ("train", "eval")),
}


def source(name: str) -> str | None:
    """The launch whose checkpoint-5 launch ``name`` resumes in its ``from`` task (None if it has none)."""
    tasks = [t for t in LAUNCHES[name][2] if t.startswith("from=")]
    return tasks[0].removeprefix("from=") if tasks else None


def launched(root: Path, name: str) -> Path:
    """The output folder of launch ``name`` under ``root``, run on first use (a failed launch fails every test that
    reads it, without running it again)."""
    nproc, sizes, tasks = LAUNCHES[name]
    tasks = tuple(f"from={launched(root, t.removeprefix('from='))}" if t.startswith("from=") else t for t in tasks)
    return launch_once(root / name, name, JOB, nproc, sizes, *tasks)
