"""Ranks started by srun or mpirun (no torchrun): real gloo groups built from SLURM_* / OMPI_* variables."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

JOB = "tests.distributed.launcher_env_job"
pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(launcher: str, rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
    if launcher == "slurm":  # srun: the main address comes from the node list
        env.update(
            SLURM_STEP_ID="0",
            SLURM_NTASKS="2",
            SLURM_NNODES="1",
            SLURM_NODEID="0",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_STEP_NODELIST="localhost",
        )
    else:  # mpirun exports no address: the user sets MASTER_ADDR
        env.update(
            OMPI_COMM_WORLD_SIZE="2",
            OMPI_COMM_WORLD_LOCAL_SIZE="2",
            OMPI_COMM_WORLD_RANK=str(rank),
            OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
        )
    return env


def _run(launcher: str, out: Path, mode: str) -> list[dict]:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", JOB, str(out), mode],
            env=_env(launcher, rank, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:  # a rank that hung must not outlive the test
            p.kill()
    records = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        if path.exists():
            records.append(json.loads(path.read_text()))
    assert records, "no rank finished:\n" + "\n".join(logs)
    return records


@pytest.mark.parametrize("launcher", ["slurm", "openmpi"])
def test_ranks_from_the_launchers_variables_form_one_group(tmp_path: Path, launcher: str) -> None:
    records = _run(launcher, tmp_path, "ok")
    assert len(records) == 2
    assert {r["source"] for r in records} == {launcher}
    assert sorted(r["rank"] for r in records) == [0, 1]
    assert sorted(r["local_rank"] for r in records) == [0, 1]
    assert all(r["world"] == 2 and r["backend"] == "gloo" and r["sum"] == 3.0 for r in records)
    assert all(r["parallel_mode"] == "ParallelMode.DISTRIBUTED" for r in records)


def test_ddp_timeout_reaches_the_process_group(tmp_path: Path) -> None:
    """Rank 1 never enters the barrier: rank 0 fails after ddp_timeout=3 s, not transformers' 1800 s."""
    (record,) = _run("slurm", tmp_path, "timeout")
    assert record["rank"] == 0
    assert record["error"] is not None
    assert 2.5 <= record["waited"] < 7.5  # rank 1 exits at 8 s: failing before that is the timeout
