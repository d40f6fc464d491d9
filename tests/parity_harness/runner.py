"""Running both implementations: one batch process each, side by side, and the ranks of one launch.

A set's batch is one process per implementation (``python -m <the set's batch module> --impl IMPL ...``, this
interpreter, which needs accelerate for the stock side) that imports the implementation once; the two batches run
at the same time and write their results where the set's comparison reads them. A launch of several ranks forks them
from a warm server (:mod:`tests.helpers.forked_ranks`) or starts them with ``torch.distributed.run --standalone``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.helpers import forked_ranks

from .registry import IMPLS

ROOT = Path(__file__).resolve().parents[2]  # the repository root: ``-m tests.<set>.<module>`` is found there
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TERMINATE_GRACE_S = 30  # after SIGTERM (the ranks print their stacks), SIGKILL for whatever is left


def side_by_side(
    command: Callable[[str], list[str]],
    impls: tuple[str, ...] = IMPLS,
    timeout: float | None = None,
    jobs: int | None = None,
) -> dict[str, str]:
    """``command(impl)`` for every implementation, ``jobs`` at a time (default: all at once), from the repository root.

    Returns ``{impl: why its batch failed}`` (``""`` where it exited 0): the caller reports each case a failed batch
    left without a result.
    """

    def run(impl: str) -> str:
        argv = command(impl)
        try:
            process = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return f"{' '.join(argv)} timed out after {exc.timeout:.0f}s"
        if process.returncode == 0:
            return ""
        return f"{' '.join(argv)} exited with {process.returncode}:\n{(process.stdout + process.stderr)[-6000:]}"

    with ThreadPoolExecutor(max_workers=jobs or len(impls)) as pool:
        return dict(zip(impls, pool.map(run, impls), strict=True))


def batch_command(module: str, impl: str, *args: str) -> list[str]:
    """``python -m module --impl impl args...`` with this interpreter."""
    return [sys.executable, "-m", module, "--impl", impl, *args]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for the ranks of a launch: no launcher variables, the repository importable, one
    OpenMP thread, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def launch_ranks(
    module: str,
    nproc: int,
    args: list[str],
    env: Mapping[str, str],
    timeout: float,
    cwd: Path,
    log_path: Path,
    forked: bool,
) -> str:
    """``module`` on ``nproc`` ranks, every rank's output in ``log_path``; its status: ``ok``, ``exit N`` or
    ``timeout (Ns)``.

    ``forked``: the ranks are forked from this process's warm server (the caller asked ``forked_ranks.usable``);
    otherwise torchrun starts them. Past ``timeout`` the ranks get SIGTERM (torchrun passes it on), print their stacks
    (the log then shows where each one hung), then SIGKILL for whatever is left.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if forked:
        log_path.write_text("")
        try:
            code = forked_ranks.run(module, nproc, args, dict(env), timeout, cwd=cwd, log=log_path).returncode
        except subprocess.TimeoutExpired:
            return f"timeout ({timeout:.0f}s)"
        return "ok" if code == 0 else f"exit {code}"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "--max_restarts=0",
        "-m", module, *args,
    ]  # fmt: skip
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=cwd, env=dict(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            return f"timeout ({timeout:.0f}s)"
    return "ok" if process.returncode == 0 else f"exit {process.returncode}"


def result_path(outdir: Path, case: str, impl: str, nproc: int | None = None) -> Path:
    """Where a batch writes one case's result: ``OUTDIR/CASE.IMPL[.NPROC].json``."""
    return outdir / (f"{case}.{impl}.json" if nproc is None else f"{case}.{impl}.{nproc}.json")
