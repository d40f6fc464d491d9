"""BarrierCallback: every rank meets around checkpoint saves, evaluation and the end of training, with a timeout.

A plain barrier that one rank never reaches hangs until the process-group timeout (30 minutes by default) and then
says nothing useful. ``torch.distributed.monitored_barrier`` on a gloo group instead reports, on rank 0, which ranks
did not arrive; the error raised here adds the stage ("before checkpoint save at step 20"). NCCL jobs get a gloo side
group, created once while all ranks are at the start of training.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback


class BarrierTimeoutError(RuntimeError):
    """A rank did not reach a barrier in time; ``stage`` says which, ``missing`` lists them (known on rank 0)."""

    def __init__(self, message: str, stage: str, missing: list[int]) -> None:
        super().__init__(message)
        self.stage = stage
        self.missing = missing


def missing_ranks(error_text: str) -> list[int]:
    """The ranks named in gloo's "Ranks 1, 3 failed to pass monitoredBarrier" message ([] when none are named)."""
    match = re.search(r"Ranks? ([\d,\s]+) failed to pass monitoredBarrier", error_text)
    return [int(r) for r in re.findall(r"\d+", match.group(1))] if match else []


class BarrierCallback(TrainerCallback):
    """Timed ``wait_for_everyone`` at the stages where ranks most often drift apart.

    ``timeout`` is in seconds (or a ``timedelta``); by default ``TrainingArguments.ddp_timeout``, the time the
    process group itself would wait. A no-op on one process.
    """

    def __init__(self, timeout: float | timedelta | None = None) -> None:
        self.timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self._group: Any = None
        self._group_ready = False
        self.passed: list[str] = []  # stages passed, in order (for tests and post-mortems)

    def _gloo_group(self) -> Any:
        """None (the default group) when it is gloo, else a gloo side group created once; every rank must call it."""
        if not self._group_ready:
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            self._group_ready = True
        return self._group

    def wait(self, stage: str, args: Any) -> None:
        """Block until every rank arrives; raise :class:`BarrierTimeoutError` naming ``stage`` after the timeout."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        seconds = self.timeout if self.timeout is not None else float(args.ddp_timeout)
        group = self._gloo_group()
        started = time.monotonic()
        try:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=seconds), wait_all_ranks=True)
        except RuntimeError as error:
            rank, text = dist.get_rank(), str(error)
            missing = missing_ranks(text)
            # the time this rank actually waited: a rank that crashed ends the barrier long before the timeout
            waited = f"after waiting {time.monotonic() - started:.1f} s (timeout {seconds:g} s)"
            first_line = text.splitlines()[0] if text else type(error).__name__
            if missing:
                message = (
                    f"ranks {', '.join(map(str, missing))} did not reach the barrier {stage}: rank {rank} gave up "
                    f"{waited}. A rank is stuck, crashed, or took a different path; see its own log"
                )
            elif rank == 0:
                message = (
                    f"rank 0 lost another rank at the barrier {stage} {waited} ({first_line}); a rank crashed or "
                    "left; see its own log"
                )
            else:
                message = (
                    f"rank {rank} reached the barrier {stage} but was not released by rank 0; it gave up {waited} "
                    f"({first_line}); rank 0's error names the ranks that did not arrive"
                )
            raise BarrierTimeoutError(message, stage, missing) from error
        self.passed.append(stage)

    def on_train_begin(self, args, state, control, **kwargs):
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._gloo_group()  # a collective: create the side group while every rank is here

    def on_step_end(self, args, state, control, **kwargs):
        # DefaultFlowCallback (first in the list) has already decided whether this step evaluates or saves
        if control.should_evaluate:
            self.wait(f"before evaluation at step {state.global_step}", args)
        elif control.should_save:
            self.wait(f"before checkpoint save at step {state.global_step}", args)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_evaluate:
            self.wait(f"before evaluation at the end of epoch {state.epoch:g} (step {state.global_step})", args)
        elif control.should_save:
            self.wait(f"before checkpoint save at the end of epoch {state.epoch:g} (step {state.global_step})", args)

    def on_evaluate(self, args, state, control, **kwargs):
        self.wait(f"after evaluation at step {state.global_step}", args)

    def on_save(self, args, state, control, **kwargs):
        self.wait(f"after checkpoint save at step {state.global_step}", args)

    def on_train_end(self, args, state, control, **kwargs):
        self.wait(f"at the end of training (step {state.global_step})", args)
