"""Preemption: SIGTERM/SIGUSR1 → every rank saves a checkpoint at the next step boundary, then exits.

The signal handler only sets a flag. At agreed step ends the flag is reduced (max) across ranks, so one
rank's signal makes all ranks save the same step. Training stops after that save and ``train()`` raises
:class:`Preempted` (a ``SystemExit``) with a distinct exit code that a requeue script can test for.

On several ranks the reduction is a collective, so it does not run at every step: by default the ranks agree about
every :data:`AUTO_INTERVAL_SECONDS` (the slowest rank's step time rides on the same reduction and sets the next
check), and always at the last step, so a signal is acted on within that interval plus one step.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# EX_TEMPFAIL (sysexits.h): "try again later" — distinct from crashes (1), signals (128+n) and success (0)
DEFAULT_EXIT_CODE = 75
# on several ranks: seconds of training between two agreements on the flag (a tenth of the grace time if shorter)
AUTO_INTERVAL_SECONDS = 2.0
MAX_CHECK_STEPS = 10_000


class Preempted(SystemExit):
    """Raised by ``train()`` after the preemption checkpoint is written; its code is the exit code."""


class PreemptionFlag:
    """Records the first SIGTERM/SIGUSR1 received; installs and restores the handlers."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum, self.received_at = signum, time.monotonic()

    def install(self) -> bool:
        """Catch the signals (main thread only; elsewhere Python cannot, and nothing is installed)."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return bool(self._previous)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        """Put back the handlers found at install time."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _agreed(flag: bool, step_seconds: float, group: Any = None) -> tuple[bool, float]:
    """(any rank has the flag, the slowest rank's step time): one max all-reduce of a CPU tensor, no device sync."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag, step_seconds
    value = torch.tensor([1.0 if flag else 0.0, step_seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value[0] > 0), float(value[1])


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def steps_between_checks(step_seconds: float, interval_seconds: float) -> int:
    """Optimizer steps that take about ``interval_seconds`` at ``step_seconds`` each (1 to MAX_CHECK_STEPS)."""
    if step_seconds <= 0:
        return 1
    return max(1, min(MAX_CHECK_STEPS, round(interval_seconds / step_seconds)))


class PreemptionCallback(TrainerCallback):
    """Turns a received SIGTERM/SIGUSR1 into save-and-stop at an agreed step boundary on every rank.

    ``check_every`` agrees every N optimizer steps; None (the default) adapts N to the step time on several ranks
    (about every ``AUTO_INTERVAL_SECONDS``, at most a tenth of ``grace_seconds``) and checks every step on one.
    """

    def __init__(self, grace_seconds: float, check_every: int | None = None) -> None:
        self.flag = PreemptionFlag()
        self._group: Any = None
        self.grace_seconds = grace_seconds
        self.check_every = None if check_every is None else max(1, check_every)
        self.interval_seconds = min(AUTO_INTERVAL_SECONDS, grace_seconds / 10)
        self.preempted_at: int | None = None
        self._next_check: int | None = None  # None: at the next step end
        self._last_check: tuple[int, float] | None = None  # (step, time) of the previous agreement

    def on_train_begin(self, args, state, control, **kwargs):
        self.preempted_at, self._next_check, self._last_check = None, None, None
        # NCCL runs get a gloo side group from the distributed state, so the flag check never syncs the GPU
        state = getattr(args, "distributed_state", None)
        self._group = state.host_group() if state is not None else None
        if not self.flag.install():
            logger.warning("preemption signals are not caught: training does not run in the main thread")

    def _due(self, state, control) -> bool:
        """Whether this step end agrees on the flag: the same answer on every rank (steps, not clocks, decide)."""
        if self.check_every is not None:
            return state.global_step % self.check_every == 0 or control.should_training_stop
        if self._next_check is None or control.should_training_stop or state.global_step >= state.max_steps:
            return True
        return state.global_step >= self._next_check

    def on_step_end(self, args, state, control, **kwargs):
        if not self._due(state, control):
            return control
        now = time.monotonic()
        step_seconds = 0.0
        if self._last_check is not None and state.global_step > self._last_check[0]:
            step_seconds = (now - self._last_check[1]) / (state.global_step - self._last_check[0])
        signalled, slowest = _agreed(self.flag.signum is not None, step_seconds, self._group)
        self._last_check = (state.global_step, now)
        if self.check_every is None:  # every rank computes the same N from the same reduced step time
            every = steps_between_checks(slowest, self.interval_seconds) if _several_ranks() else 1
            self._next_check = state.global_step + every
        if not signalled:
            return control
        if self.flag.signum is not None:
            waited = time.monotonic() - self.flag.received_at
            name = signal.Signals(self.flag.signum).name
            if waited > self.grace_seconds:
                logger.warning(
                    "%s came %.1fs before this step boundary, more than the %.0fs grace time: a step cannot be "
                    "cut short, the checkpoint is saved now",
                    name,
                    waited,
                    self.grace_seconds,
                )
            logger.warning("%s received: saving checkpoint-%d and stopping", name, state.global_step)
        else:
            logger.warning("another rank was preempted: saving checkpoint-%d and stopping", state.global_step)
        self.preempted_at = state.global_step
        control.should_save = True
        control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.preempted_at is None:
            self.flag.restore()
        # else keep catching: the launcher's SIGTERM to the other ranks, once one has exited, must not turn
        # a clean preemption exit into a death by signal while the process is already on its way out


def ignore_preemption_signals() -> None:
    """In a data-loader worker: leave SIGTERM/SIGUSR1 to the training process, which saves first."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class WorkerInit:
    """A data-loader ``worker_init_fn`` that ignores the preemption signals, then runs the original one."""

    def __init__(self, original: Any = None) -> None:
        self.original = original

    def __call__(self, worker_id: int) -> None:
        ignore_preemption_signals()
        if self.original is not None:
            self.original(worker_id)
