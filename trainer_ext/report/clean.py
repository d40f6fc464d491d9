"""Malformed or unplottable values in a run's files, dropped before anything is drawn, each kind said in a note.

A hand-edited, foreign or crafted ``trainer_state.json`` may hold a ``"step"`` that is no count (a string, null,
``10**400``), or numbers too large to draw (``1e308`` next to ``-1e308`` spans more than a float holds). Those entries
and values are left out; the report is drawn from the rest, and its page says what was left out.
"""

from __future__ import annotations

import math
from typing import Any

from trainer_ext.report.events import MAX_COUNT

# logged values beyond this magnitude are left out of figures and tables: a float axis spanning them overflows
VALUE_LIMIT = 1e100
# the job's fields the report shows as text
JOB_TEXT = (
    "model_name_or_path",
    "model_config",
    "dataset_name",
    "dataset_config_name",
    "train_file",
    "validation_file",
    "task",
    "metric_for_best_model",
)


def finite(value: Any) -> bool:
    """A number (not a bool) that is finite and within ±VALUE_LIMIT."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return -VALUE_LIMIT <= value <= VALUE_LIMIT
    return math.isfinite(value) and abs(value) <= VALUE_LIMIT


def is_step(value: Any) -> bool:
    """A step count: an int (not a bool) from 0 to 2**53."""
    return type(value) is int and 0 <= value <= MAX_COUNT


def _too_large(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) > VALUE_LIMIT if isinstance(value, int) or math.isfinite(value) else False


def _names(keys: dict[str, None], most: int = 5) -> str:
    shown = ", ".join(list(keys)[:most])
    return shown + (f" and {len(keys) - most:,} more" if len(keys) > most else "")


def clean_state(state: dict[str, Any], source: str, notes: list[str]) -> dict[str, Any]:
    """The trainer state with malformed log entries and fields dropped; what was dropped goes to ``notes``."""
    history = state.get("log_history")
    entries = [e for e in history if isinstance(e, dict)] if isinstance(history, list) else []
    # an entry with a step that is no count (a string, null) is skipped; one without a step is kept (no curve uses it)
    kept = [e for e in entries if "step" not in e or is_step(e["step"])]
    if len(kept) < len(entries):
        dropped = len(entries) - len(kept)
        notes.append(
            f"{dropped:,} log entr{'ies' if dropped > 1 else 'y'} of {source} skipped (a step that is no count)"
        )
    large: dict[str, None] = {}
    count = 0
    for index, entry in enumerate(kept):
        bad = [k for k, v in entry.items() if _too_large(v)]
        if bad:
            kept[index] = {k: v for k, v in entry.items() if k not in bad}
            large.update(dict.fromkeys(map(str, bad)))
            count += len(bad)
    if count:
        notes.append(
            f"{count:,} logged value{'s' if count > 1 else ''} beyond ±{VALUE_LIMIT:g} left out ({_names(large)})"
        )
    state["log_history"] = kept
    for name in ("global_step", "max_steps"):
        if name in state and not is_step(state[name]):
            del state[name]
    if "global_step" not in state:
        state["global_step"] = max((e["step"] for e in kept if "step" in e), default=0)
    if "epoch" in state and not finite(state["epoch"]):
        del state["epoch"]
    for name in ("best_model_checkpoint",):
        if name in state and not isinstance(state[name], str):
            del state[name]
    return state


def clean_job(value: Any) -> dict[str, Any] | None:
    """The job record with text fields of the wrong type dropped; None when there is none."""
    if not isinstance(value, dict) or not value:
        return None
    return {k: v for k, v in value.items() if isinstance(k, str) and (k not in JOB_TEXT or isinstance(v, str))}


def clean_results(value: dict[str, Any]) -> dict[str, Any]:
    """``all_results.json`` with the numbers too large to show left out."""
    return {k: v for k, v in value.items() if not _too_large(v)}
