"""Fault tolerance: atomic checkpoints, verified resume, safe rotation and preemption handling."""

from .marker import COMPLETE, CheckpointError, newest_complete, rotate, verify, write_marker
from .preemption import DEFAULT_EXIT_CODE, Preempted, PreemptionCallback
from .trainer_mixin import CheckpointingMixin

__all__ = [
    "COMPLETE",
    "DEFAULT_EXIT_CODE",
    "CheckpointError",
    "CheckpointingMixin",
    "Preempted",
    "PreemptionCallback",
    "newest_complete",
    "rotate",
    "verify",
    "write_marker",
]
