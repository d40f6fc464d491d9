"""Checkpoint I/O below the Trainer: atomic commit markers, verified resume, safe rotation, preemption handling."""

from trainer_ext.checkpointing.listing import rotate
from trainer_ext.checkpointing.marker import COMPLETE, CheckpointError, write_marker
from trainer_ext.checkpointing.preemption import DEFAULT_EXIT_CODE, Preempted, PreemptionCallback
from trainer_ext.checkpointing.selection import newest_complete
from trainer_ext.checkpointing.verification import verify

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
