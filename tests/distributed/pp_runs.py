"""The launches of :mod:`tests.distributed.pp_job` that the pipeline-parallel Trainer tests share: each runs once per
pytest session (eleven in all: one process, pp 2 on each of the six schedules, pp 2 × dp_shard 2, zbv_zero_bubble's
evaluation after training, pp 2 × tp 2 with an explicit split and gradient checkpointing, and FSDP2 alone) and its
results are read by every test that needs them."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.ranks import launch_once
from trainer_ext.distributed.pipeline.schedules import SCHEDULES

JOB = "tests.distributed.pp_job"
OTHER_SCHEDULES = [s for s in SCHEDULES if s != "1f1b"]
# name -> (processes, pp,dp_shard,schedule, tasks); "from=NAME[@SCHEDULE]" resumes launch NAME's checkpoint-5
LAUNCHES = {
    "one": (1, "1,1,1f1b", ("train", "eval", "from=pp2")),
    "pp2": (2, "2,1,1f1b", ("train", "export", "eval", "same_mesh", "refusals")),
    "pp_dp": (4, "2,2,1f1b", ("train", "export", "eval", "same_mesh", "from=one@interleaved_1f1b")),
    **{f"pp2_{s}": (2, f"2,1,{s}", ("train",)) for s in OTHER_SCHEDULES},
    "zbv_eval": (2, "2,1,zbv_zero_bubble", ("train", "eval")),
    # pp 2 x tp 2, stages cut after layer 0 (pp_split), layers recomputed in backward (gradient checkpointing)
    "pp_tp": (4, "2,1,1f1b,tp=2,split=1,ac", ("train", "export")),
}
LAUNCHES["pp2_interleaved_1f1b"] = (2, "2,1,interleaved_1f1b", ("train", "export", "from=pp2"))
# FSDP2 alone (dp_shard 2) resumes pp 2's checkpoint, and pp 2 on gpipe resumes FSDP2's: the optimizer state kept
# per parameter (pipeline) and per group (FSDP2) each load into the other
LAUNCHES["fsdp"] = (2, "1,2,1f1b", ("train", "from=pp2"))
LAUNCHES["pp2_gpipe"] = (2, "2,1,gpipe", ("train", "from=fsdp"))


def source(name: str) -> str | None:
    """The launch whose checkpoint-5 launch ``name`` resumes in its ``from`` task (None if it has none)."""
    tasks = [t for t in LAUNCHES[name][2] if t.startswith("from=")]
    return tasks[0].removeprefix("from=").partition("@")[0] if tasks else None


def launched(root: Path, name: str) -> Path:
    """The output folder of launch ``name`` under ``root``, run on first use (a failed launch fails every test that
    reads it, without running it again)."""
    nproc, sizes, tasks = LAUNCHES[name]
    resolved = []
    for task in tasks:
        if task.startswith("from="):
            other, at, schedule = task.removeprefix("from=").partition("@")
            task = f"from={launched(root, other)}{at}{schedule}"
        resolved.append(task)
    return launch_once(root / name, name, JOB, nproc, sizes, *resolved)
