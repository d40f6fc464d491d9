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

from ... import env_vars

if TYPE_CHECKING:
    from .plan import Plan


def execute(plan: Plan) -> int:
    """Run the plan; return the exit code of the (first failed) process."""
    if plan.torchrun_args is None:
        env = {k: v for k, v in os.environ.items() if k not in env_vars.TORCHRUN_VARS}
        return subprocess.run(plan.command, env={**env, **plan.env}).returncode
    with _environment(plan.env):
        return run_torchrun(plan.torchrun_args)


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
            if code >= 0:
                how = f"ended with exit code {code}; its own error is printed above"
            else:
                how = (
                    f"was killed by {_signal_name(-code)} from outside the job (the out-of-memory killer, a "
                    "scheduler, or kill); it printed nothing, so look at the system log (dmesg) and the scheduler's"
                )
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
    try:
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
    except SignalException as error:  # Ctrl-C or a scheduler's SIGTERM: the processes were stopped
        print(f"stopped by {error.sigval.name}: the processes were ended", file=sys.stderr)
        return 128 + int(error.sigval)
    return 0
