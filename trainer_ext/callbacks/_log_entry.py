"""Adding values to a training log line from a callback's ``on_log``.

``Trainer.log`` appends a *copy* of ``logs`` (plus ``step``) to ``state.log_history`` before it calls ``on_log``, so a
callback that only mutates ``logs`` reaches the callbacks after it (printer, progress bar) but not the history; both
are updated here.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerState


def add_to_log(state: TrainerState, logs: dict[str, Any], values: dict[str, Any]) -> None:
    """Put ``values`` in ``logs`` and in the history entry ``Trainer.log`` recorded for them just before ``on_log``."""
    logs.update(values)
    entry = state.log_history[-1] if state.log_history else None
    if entry is not None and entry.get("step") == state.global_step:
        entry.update(values)
