"""Checkpoint I/O below the Trainer: atomic commit markers, verified resume, safe rotation, preemption handling."""

from .listing import newest_complete, rotate
from .marker import COMPLETE, CheckpointError, write_marker
from .preemption import DEFAULT_EXIT_CODE, Preempted, PreemptionCallback
from .verification import verify

__all__ = [
    "COMPLETE",
    "DEFAULT_EXIT_CODE",
    "CheckpointError",
    "Preempted",
    "PreemptionCallback",
    "newest_complete",
    "rotate",
    "verify",
    "write_marker",
]
