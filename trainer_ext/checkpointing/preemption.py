"""Preemption: SIGTERM/SIGUSR1 → every rank saves a checkpoint at the next step boundary, then exits.

The signal handler only sets a flag. At each step end the flag is reduced (max) across ranks, so one
rank's signal makes all ranks save the same step. Training stops after that save and ``train()`` raises
:class:`Preempted` (a ``SystemExit``) with a distinct exit code that a requeue script can test for.
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


def _agreed(flag: bool, group: Any = None) -> bool:
    """True when any rank has the flag set: a one-element max all-reduce of a CPU tensor (no device sync)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


class PreemptionCallback(TrainerCallback):
    """Turns a received SIGTERM/SIGUSR1 into save-and-stop at the next step boundary on every rank."""

    def __init__(self, grace_seconds: float, check_every: int = 1) -> None:
        self.flag = PreemptionFlag()
        self._group: Any = None
        self.grace_seconds = grace_seconds
        self.check_every = max(1, check_every)
        self.preempted_at: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.preempted_at = None
        # NCCL runs get a gloo side group from the distributed state, so the per-step flag check never syncs the GPU
        state = getattr(args, "distributed_state", None)
        self._group = state.host_group() if state is not None else None
        if not self.flag.install():
            logger.warning("preemption signals are not caught: training does not run in the main thread")

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.check_every:
            return control  # every rank skips the same steps: the reduction stays collective
        if not _agreed(self.flag.signum is not None, self._group):
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
