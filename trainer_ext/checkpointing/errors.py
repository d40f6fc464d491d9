"""The error of checkpoint I/O: a checkpoint folder that must not be resumed from (``marker`` re-exports it)."""


class CheckpointError(Exception):
    """A checkpoint directory that must not be resumed from; the message says why."""
