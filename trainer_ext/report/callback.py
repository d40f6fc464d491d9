"""ReportCallback: records a job's events and writes its report at checkpoints (rate-limited) and at the end.

Attached by ``train(args)`` / ``trainer-ext train`` (``--report_plots``, on by default) as one of the engine's duties,
so a script's callback list is unchanged and a plain ``trainer_ext.Trainer`` writes nothing extra. It also attaches a
:class:`~trainer_ext.callbacks.ThroughputCallback` (unless one is there already) for samples/s, tokens/s and MFU, and
adds the running count ``tokens_seen`` to training log lines from it (no extra collective: the throughput callback
already sums its window over ranks), unless transformers counts ``num_input_tokens_seen`` itself.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trainer_ext.callbacks._log_entry import add_to_log
from trainer_ext.callbacks.throughput import ThroughputCallback
from trainer_ext.report.events import append_event, start_fresh, this_process

logger = logging.getLogger(__name__)

REPORT_DIR = "report"
# at a checkpoint the report is rewritten only when that keeps its cost under 1/REFRESH_RATIO of the training time
# since the last one (the first estimate of its cost, matplotlib's import included, is FIRST_ESTIMATE seconds)
REFRESH_RATIO = 20
FIRST_ESTIMATE = 1.0


class ReportCallback(TrainerCallback):
    """Events to ``trainer_ext_events.jsonl``; the report to ``output_dir/report`` at checkpoints and on :meth:`finish`."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = weakref.ref(trainer)
        self._tokens = 0.0
        self._last_write = time.perf_counter()  # at the end of the last report (or the start of training)
        self._write_seconds = FIRST_ESTIMATE
        self._warned = False
        self._warned_events = False
        self._warned_figures = False
        self.written: list[Path] = []  # the reports written so far (for tests and the log)

    @property
    def output_dir(self) -> Path:
        return Path(self._trainer().args.output_dir)

    def on_train_begin(self, args, state, control, **kwargs):
        self._tokens = next((float(e["tokens_seen"]) for e in reversed(state.log_history) if "tokens_seen" in e), 0.0)
        if not state.is_world_process_zero:
            return
        self._last_write = time.perf_counter()
        resumed = state.global_step > 0
        if not resumed:
            try:
                start_fresh(args.output_dir)
            except OSError as error:
                self._event_failed(args.output_dir, error)
        trainer = self._trainer()
        engine = getattr(trainer, "accelerator", None)
        strategy = getattr(getattr(engine, "strategy", None), "name", None)
        per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
        self._event(
            args.output_dir,
            "start",
            step=state.global_step,
            resumed=resumed,
            max_steps=state.max_steps,
            world_size=args.world_size,
            strategy=strategy,
            precision=getattr(engine, "mixed_precision", None),
            per_device_batch=per_device,
            accumulation=accumulation,
            global_batch=args.world_size * per_device * accumulation,
            argv=list(sys.argv),
            metric_for_best_model=getattr(args, "metric_for_best_model", None),
            greater_is_better=getattr(args, "greater_is_better", None),
            **this_process(),
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        if "loss" in logs and "num_input_tokens_seen" not in logs:
            trainer = self._trainer()
            throughput = trainer.callback_handler.duty(ThroughputCallback) if trainer is not None else None
            window = getattr(throughput, "last_window", None) or {}
            if window.get("tokens"):
                self._tokens += window["tokens"]
                add_to_log(state, logs, {"tokens_seen": int(self._tokens)})
        if state.is_world_process_zero:
            self._event(args.output_dir, "log", step=state.global_step)

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self._event(args.output_dir, "save", step=state.global_step, checkpoint=f"checkpoint-{state.global_step}")
        if not any("step" in entry for entry in state.log_history):
            return  # nothing logged before this checkpoint: no curve to draw yet, and nothing wrong
        if time.perf_counter() - self._last_write >= REFRESH_RATIO * self._write_seconds:
            self._write(partial=True, step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            status = "finished" if state.global_step >= state.max_steps else "stopped"
            self._event(args.output_dir, "end", step=state.global_step, status=status)

    def _event(self, output_dir: Any, kind: str, **fields: Any) -> None:
        """Append to the event log; a failed write (a full disk) warns once and training goes on."""
        try:
            append_event(output_dir, kind, **fields)
        except (OSError, TypeError, ValueError) as error:
            self._event_failed(output_dir, error)

    def _event_failed(self, output_dir: Any, error: Exception) -> None:
        if not self._warned_events:  # once: a full disk fails every write after the first
            logger.warning(
                "report_plots: the event log in %s could not be written (%s); training goes on, the report "
                "will lack resumes and wall-clock times",
                output_dir,
                error,
            )
            self._warned_events = True

    def finish(self) -> Path | None:
        """Write the full report (after the final evaluation and ``trainer_state.json``); main process only."""
        trainer = self._trainer()
        if trainer is None or not trainer.is_world_process_zero():
            return None
        return self._write(partial=False)

    def _write(self, *, partial: bool, step: int | None = None) -> Path | None:
        from trainer_ext.report.build import matplotlib_missing, write_report
        from trainer_ext.report.summary import is_train_command

        began = time.perf_counter()
        who = "trainer-ext train" if is_train_command(sys.argv) else "trainer_ext.train()"
        missing = matplotlib_missing()
        if missing and not self._warned_figures:
            logger.warning("report_plots: %s; the report holds its tables only", missing)
            self._warned_figures = True
        try:
            page = write_report(
                [self.output_dir],
                self.output_dir / REPORT_DIR,
                allow_running=partial,
                require_figures=False,
                this_one_trains=partial,
                written_by=f"{who} at checkpoint-{step}, while training" if partial else f"{who} when training ended",
            )
        except Exception as error:  # a report must never cost the run: say why and carry on
            if not self._warned:
                logger.warning("report_plots: the report could not be written (%s); training goes on", error)
                self._warned = True
            return None
        self._last_write = time.perf_counter()
        self._write_seconds = self._last_write - began
        self.written.append(page)
        if not partial:
            logger.info("report written to %s (%.1f s)", page, self._write_seconds)
        return page


def attach_report(trainer: Any) -> ReportCallback:
    """Add the report's duties to ``trainer`` (a trainer_ext.Trainer): throughput (if absent), then the report."""
    handler = trainer.callback_handler
    if handler.duty(ThroughputCallback) is None:
        handler.add_duty(ThroughputCallback())
    callback = ReportCallback(trainer)
    handler.add_duty(callback)
    return callback
