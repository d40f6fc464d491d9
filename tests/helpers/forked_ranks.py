"""N real gloo ranks forked from a warm server instead of started by torchrun: the same job, seconds sooner.

Every rank torchrun starts pays the interpreter's start and the import of torch and transformers (about 4 s of CPU
on the CI machines, 6 s of wall time for a 2-rank launch), which made process start-up the largest part of the
suite. Here a ``multiprocessing`` fork server imports them once (:mod:`tests.helpers.warm_imports`) and each rank
is forked from it: a fresh process, its own gloo process group on loopback, the launcher variables torchrun sets,
the caller's working directory, its output in files, the interpreter's exit handlers run at the end.

The tests' rank jobs go this way (:func:`tests.helpers.ranks.run_ranks`), and the accelerator parity batches (one
server per implementation); the tests of launching (``trainer-ext launch``, the scripts, restarts, signals) start
real launchers. ``TRAINER_EXT_TEST_TORCHRUN=1`` sends
every job through torchrun too, and an environment that differs from the one the server started with (a test that
set a variable the imports may read) always does.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import random
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from pathlib import Path

# set per process or per test; everything else must equal the server's environment
_PER_CALL = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE",
    }
)
# read when used, never by the warm imports (which leave DeepSpeed and the trackers out): set in-process by code a test
# ran (TrainingArguments sets DS_ACCELERATOR for DeepSpeed on CPU, DeepSpeed's import sets the NVML check, trackers
# theirs); a rank gets them all the same, in its environment
_READ_WHEN_USED = ("DS_", "PYTORCH_NVML_BASED_CUDA_CHECK", "WANDB_", "MLFLOW_", "COMET_", "CLEARML_", "TRACKIO_")
FORCE_TORCHRUN = "TRAINER_EXT_TEST_TORCHRUN"

DEFAULT_PRELOAD = "tests.helpers.warm_imports"

_server: tuple[str, dict[str, str]] | None = None  # the server's preload module and environment, once started


def usable(env: dict[str, str], preload: str = DEFAULT_PRELOAD) -> bool:
    """Whether ranks with environment ``env`` may be forked from this process's server, started on first use
    with ``preload`` as its warm imports (a process has one server: another ``preload`` later is refused)."""
    global _server
    if os.environ.get(FORCE_TORCHRUN) == "1" or sys.platform != "linux":
        return False
    if _server is None:
        _start(env, preload)
        _server = (preload, _comparable(env))
    if _server[0] != preload:
        return False
    now = _comparable(env)
    changed = sorted(k for k in set(now) | set(_server[1]) if now.get(k) != _server[1].get(k))
    if changed:
        warnings.warn(
            f"ranks started by torchrun, not forked: {', '.join(changed)} changed since the fork server started",
            stacklevel=3,
        )
    return not changed


def _comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _PER_CALL and not k.startswith(_READ_WHEN_USED)}


def _start(env: dict[str, str], preload: str) -> None:
    """Start the fork server with ``env`` as its environment (OpenMP reads its thread count when torch loads)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload([preload])
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(module: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """One rank: its output into files, torchrun's variables, ``python -m module argv``, exit handlers at the end.

    ``out`` and ``err`` may be the same file (appended to by every rank, as torchrun's own output).
    """
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # a forked process inherits its server's random states; a started one seeds its own
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()  # what the interpreter runs at a normal exit (the process group's teardown)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run(
    module: str,
    nproc: int,
    args: tuple[str, ...] | list[str],
    env: dict[str, str],
    timeout: float,
    cwd: str | os.PathLike | None = None,
    log: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """``module`` on ``nproc`` forked ranks; returns what ``subprocess.run`` would (the ranks' outputs in rank order,
    or empty where ``log`` takes every rank's output, interleaved).

    As torchrun, the first rank to fail stops the others (SIGTERM, then SIGKILL); past ``timeout`` every rank is
    stopped that way and :class:`subprocess.TimeoutExpired` raised.
    """
    context = multiprocessing.get_context("forkserver")
    port = _free_port()
    run_id = uuid.uuid4().hex[:12]
    folder = Path(tempfile.mkdtemp(prefix="ranks-"))
    procs = []
    try:
        for rank in range(nproc):
            files = (str(log),) * 2 if log is not None else (str(folder / f"{rank}.out"), str(folder / f"{rank}.err"))
            target_args = (
                module,
                list(args),
                _rank_env(env, rank, nproc, port, run_id),
                os.fspath(cwd or os.getcwd()),
            )
            proc = context.Process(target=_rank_main, args=(*target_args, *files))
            proc.start()
            procs.append(proc)
        deadline = time.monotonic() + timeout
        failed = 0  # the exit code of the first rank that failed (the others are then stopped, as torchrun does)
        while not failed and any(p.exitcode is None for p in procs):
            if time.monotonic() > deadline:
                _stop(procs)
                raise subprocess.TimeoutExpired([module, *args], timeout, _read(folder, nproc, "out"))
            time.sleep(0.02)
            failed = next((p.exitcode for p in procs if p.exitcode not in (None, 0)), 0)
        _stop(procs)
        failed = failed or next((p.exitcode for p in procs if p.exitcode != 0), 0)
        return subprocess.CompletedProcess(
            [module, *args], failed, _read(folder, nproc, "out"), _read(folder, nproc, "err")
        )
    finally:
        _stop(procs)
        shutil.rmtree(folder, ignore_errors=True)


def _rank_env(env: dict[str, str], rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """``env`` with the variables torchrun gives rank ``rank`` of ``nproc`` on one machine (its own store: rank 0's)."""
    rank_env = {k: v for k, v in env.items() if k == "PYTEST_CURRENT_TEST" or k not in _PER_CALL}
    rank_env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR="localhost",  # torchrun --standalone's
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
    )
    return rank_env


def _stop(procs: list) -> None:
    """SIGTERM the ranks still running, then SIGKILL what is left after 5 s (torchrun's order)."""
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    for proc in procs:
        proc.join(5)
        if proc.exitcode is None:
            proc.kill()
            proc.join()


def _read(folder: Path, nproc: int, kind: str) -> str:
    paths = [folder / f"{rank}.{kind}" for rank in range(nproc)]
    return "".join(path.read_text(errors="replace") for path in paths if path.exists())
