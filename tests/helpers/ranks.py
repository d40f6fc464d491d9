"""Run a job module on N real gloo ranks through torchrun on loopback (free port, never a fixed one)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import ModuleType

from tests.helpers.paths import ROOT


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the repository root first on PYTHONPATH.

    A child started as ``python -m tests.…`` then finds this package whatever its working directory.
    """
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_ranks(job: ModuleType | str, nproc: int, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc -m job args``; raises with the output on failure.

    ``job`` is a module of this package (``tests.helpers.jobs``, or the module object): every rank runs it as
    ``python -m`` with the repository root on its PYTHONPATH, so it imports its helpers as ``tests.…`` like the
    tests do.
    """
    module = job.__name__ if isinstance(job, ModuleType) else job
    env = child_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--max_restarts=0",
        "-m",
        module,
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{nproc}-rank run of {module} failed (exit {proc.returncode})\nSTDOUT:\n{proc.stdout[-5000:]}\n"
            f"STDERR:\n{proc.stderr[-8000:]}"
        )
    return proc
