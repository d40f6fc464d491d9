"""Start the planned processes: one directly, several through ``torch.distributed.run`` with a short diagnosis
of its failures."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from trainer_ext import env_vars

if TYPE_CHECKING:
    from trainer_ext.cli.launch.plan import Plan


def execute(plan: Plan) -> int:
    """Run the plan; return the exit code of the (first failed) process."""
    if plan.torchrun_args is None:
        env = {k: v for k, v in os.environ.items() if k not in env_vars.TORCHRUN_VARS}
        return run_one(plan.command, {**env, **plan.env})
    with _environment(plan.env):
        return run_torchrun(plan.torchrun_args)


# passed on to a process started directly (as torchrun passes them on to its processes): a scheduler's stop and
# preemption warning reach the job even when only the launcher is signalled. SIGINT reaches it from the terminal.
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def run_one(command: Sequence[str], env: Mapping[str, str]) -> int:
    """One process, started directly; the signals in FORWARDED are passed on to it and its exit code is the
    launcher's (75 after a preemption save; 128 + N when it died of signal N)."""
    process = subprocess.Popen(list(command), env=dict(env))

    def forward(number: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(number)

    previous = {number: signal.signal(number, forward) for number in FORWARDED}
    try:
        try:
            code = process.wait()
        except KeyboardInterrupt:  # Ctrl-C reached the process as well: it ends as it does (a save, say)
            try:
                code = process.wait()
            except KeyboardInterrupt:  # a second one: stop it now
                process.kill()
                raise
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    return code if code >= 0 else 128 - code


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} ({number})"
    except ValueError:
        return f"signal {number}"


# signals a process raises against itself when it crashes (bad memory access, abort, illegal instruction ...)
_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGSYS, signal.SIGTRAP}


def _killed(number: int) -> str:
    """How a rank that died of signal ``number`` died, and where to look."""
    name = _signal_name(number)
    if number in {int(s) for s in _CRASHES}:
        return (
            f"crashed with {name} inside the process (native code such as a C/CUDA extension, or an abort); "
            "the traceback, if any, is above; run that rank with PYTHONFAULTHANDLER=1 to see where"
        )
    if number == int(signal.SIGKILL):
        return (
            f"was killed by {name} from outside the job (possibly the out-of-memory killer, or a scheduler, or "
            "kill); it printed nothing, so look at the system log (dmesg) and the scheduler's"
        )
    return f"was ended by {name} (sent by kill, a scheduler, or the process itself); it printed nothing above"


def describe_failures(failures: Mapping[int, Any]) -> list[str]:
    """One line per failed rank, the one that failed first named as such and told apart from those the launcher
    stopped because of it (torchrun ends the others with SIGTERM once one fails).

    ``failures``: rank -> torchrun's ProcessFailure (``exitcode`` negative for a signal, ``timestamp``, ``pid``).
    """
    stopped_by_us = -int(signal.SIGTERM)
    order = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[1].exitcode == stopped_by_us, item[0]))
    first_rank, first = order[0]
    lines = []
    for rank, failure in order:
        who = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
        code = failure.exitcode
        if rank == first_rank:
            how = f"ended with exit code {code}; its own error is printed above" if code >= 0 else _killed(-code)
            lines.append(f"{who} failed first: {how}")
        elif code == stopped_by_us:
            lines.append(f"{who} was stopped by the launcher after rank {first_rank} failed")
        elif code >= 0:
            lines.append(f"{who} then ended with exit code {code}")
        else:
            lines.append(f"{who} then died of {_signal_name(-code)}")
    return lines


def run_torchrun(torchrun_args: Sequence[str]) -> int:
    """``torch.distributed.run`` with these arguments, in this process; the exit code of the first failure."""
    import torch.distributed as dist
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    args = torchrun.parse_args(list(torchrun_args))
    ended: dict[int, int | None] = {}  # local rank -> exit code, of the processes torchrun closed last
    try:
        with _exit_codes_kept(ended):
            torchrun.run(args)
    except ChildFailedError as error:
        for index, line in enumerate(describe_failures(error.failures)):
            print(f"error: {line}" if index == 0 else f"  {line}", file=sys.stderr)  # one error line: the cause
        # the code of a rank that ended by itself (e.g. 75 after a preemption save), not of the ranks torchrun
        # stopped afterwards: those only say another one ended first
        ended = sorted((f.timestamp, f.exitcode) for f in error.failures.values() if f.exitcode > 0)
        return ended[0][1] if ended else 1
    except (RendezvousError, dist.DistStoreError, TimeoutError) as error:
        where = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"
        why = " ".join(str(error).split()) or "no answer before the rendezvous timeout"
        print(
            f"error: the machines did not meet at {where} ({type(error).__name__}: {why}). "
            "Start the same launch command on every machine, each with its own --machine_rank; check that "
            "machine 0's address and port are reachable from the others (firewall, interface) and that "
            "--num_machines is the same everywhere",
            file=sys.stderr,
        )
        return 1
    except SignalException as error:  # Ctrl-C or a scheduler's SIGTERM: torchrun passed it on to the processes
        return _stopped(error.sigval, ended)
    return 0


def _stopped(sigval: signal.Signals, ended: Mapping[int, int | None]) -> int:
    """The launcher's exit code after ``sigval``: the ranks' own code when they all ended by themselves (75 after
    a preemption save, which a scheduler script requeues on), else 128 + the signal."""
    codes = [ended.get(rank) for rank in sorted(ended)]
    if codes and all(code is not None and code >= 0 for code in codes):
        code = next((c for c in codes if c), 0)  # the first rank that ended with an error code, else 0
        print(f"stopped by {sigval.name}: the processes ended by themselves with exit code {code}", file=sys.stderr)
        return code
    how = ", ".join(f"rank {rank}: {_ending(code)}" for rank, code in sorted(ended.items())) or "none started"
    print(f"stopped by {sigval.name}: the processes were ended ({how})", file=sys.stderr)
    return 128 + int(sigval)


def _ending(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"exit code {code}" if code >= 0 else _signal_name(-code)


@contextlib.contextmanager
def _exit_codes_kept(ended: dict[int, int | None]) -> Iterator[None]:
    """Record, in ``ended``, the exit codes of the processes each time torchrun closes them (it does not return
    them when a signal stops it)."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    own = "close" in vars(SubprocessContext)
    close = SubprocessContext.close

    def close_and_keep(context: SubprocessContext, *args: Any, **kwargs: Any) -> None:
        try:
            close(context, *args, **kwargs)
        finally:
            handlers = getattr(context, "subprocess_handlers", None) or {}
            ended.clear()
            ended.update({rank: handler.proc.poll() for rank, handler in handlers.items()})

    SubprocessContext.close = close_and_keep  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own:
            SubprocessContext.close = close  # type: ignore[method-assign]
        else:
            del SubprocessContext.close  # inherited again
