"""Experiment trackers for hand-written loops (the Trainer keeps transformers' ``report_to``).

Names map to implementations here; a tracker that is not installed is a clear error naming the extra.
"""

from __future__ import annotations

from collections.abc import Iterable

from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.trackers.base import Tracker
from trainer_ext.trackers.blank import BlankTracker
from trainer_ext.trackers.mlflow import MLflowTracker
from trainer_ext.trackers.tensorboard import TensorBoardTracker
from trainer_ext.trackers.trackio import TrackioTracker
from trainer_ext.trackers.wandb import WandBTracker

TRACKERS: dict[str, type[Tracker]] = {
    cls.name: cls for cls in (TensorBoardTracker, WandBTracker, MLflowTracker, TrackioTracker)
}


def resolve_trackers(log_with: str | Tracker | Iterable[str | Tracker] | None) -> list[str | Tracker]:
    """Tracker names (checked and installed) or ready Tracker objects; ``"all"`` means every installed one."""
    if log_with is None:
        return []
    items = [log_with] if isinstance(log_with, (str, Tracker)) else list(log_with)
    out: list[str | Tracker] = []
    for item in items:
        if isinstance(item, Tracker):
            out.append(item)
        elif item == "all":
            out += [name for name, cls in TRACKERS.items() if cls.available() and name not in out]
        elif item in TRACKERS:
            TRACKERS[item].check_installed()
            out.append(item)
        else:
            raise ConfigError(
                f"unknown tracker {item!r}; known: {', '.join(TRACKERS)}, all.{did_you_mean(item, TRACKERS)}"
            )
    return out


__all__ = [
    "TRACKERS",
    "BlankTracker",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "TrackioTracker",
    "WandBTracker",
    "resolve_trackers",
]
