"""Run a job module on N real gloo ranks on loopback (free port, never a fixed one): forked from a warm server
(:mod:`tests.helpers.forked_ranks`) or, where that cannot serve, through torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.helpers import forked_ranks
from tests.helpers.paths import ROOT
from tests.helpers.slowness import scaled


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the repository root first on PYTHONPATH.

    A child started as ``python -m tests.…`` then finds this package whatever its working directory.
    """
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_ranks(job: ModuleType | str, nproc: int, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc -m job args``, or its equivalent forked from the warm server;
    raises with the output on failure.

    ``job`` is a module of this package (``tests.helpers.jobs``, or the module object): every rank runs it as
    ``python -m`` with the repository root on its PYTHONPATH, so it imports its helpers as ``tests.…`` like the
    tests do. The ranks get torchrun's variables either way; ``TRAINER_EXT_TEST_TORCHRUN=1`` forces torchrun.
    """
    module = job.__name__ if isinstance(job, ModuleType) else job
    env = child_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if forked_ranks.usable(env):
        proc = forked_ranks.run(module, nproc, args, env, scaled(timeout))
        _check(proc, nproc, module)
        return proc
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
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)  # scaled by conftest
    _check(proc, nproc, module)
    return proc


def _check(proc: subprocess.CompletedProcess, nproc: int, module: str) -> None:
    if proc.returncode != 0:
        raise AssertionError(
            f"{nproc}-rank run of {module} failed (exit {proc.returncode})\nSTDOUT:\n{proc.stdout[-5000:]}\n"
            f"STDERR:\n{proc.stderr[-8000:]}"
        )


_launched: dict[Path, Path | BaseException] = {}


def launch_once(out: Path, name: str, job: ModuleType | str, nproc: int, *args: str, timeout: float = 600.0) -> Path:
    """``out``, after ``run_ranks(job, nproc, str(out), *args)`` ran there once per pytest session: tests sharing a
    launch read its results; a failed launch fails every test that reads it, without running it again."""
    if out not in _launched:
        try:
            run_ranks(job, nproc, str(out), *args, timeout=timeout)
            _launched[out] = out
        except BaseException as error:
            _launched[out] = error
    if isinstance(_launched[out], BaseException):
        raise AssertionError(f"the {name} launch failed") from _launched[out]
    return out
