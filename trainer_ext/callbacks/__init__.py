"""Callbacks trainer_ext adds to the Trainer; one per module."""

from trainer_ext.callbacks.barrier import BarrierCallback, BarrierTimeoutError
from trainer_ext.callbacks.main_process_logging import MainProcessLoggingCallback
from trainer_ext.callbacks.nan_guard import NaNGuardCallback, NonFiniteStep
from trainer_ext.callbacks.run_summary import RunSummaryCallback
from trainer_ext.callbacks.throughput import ThroughputCallback
from trainer_ext.callbacks.unwrap_and_save import SavedModelMismatchError, UnwrapAndSaveCallback

__all__ = [
    "BarrierCallback",
    "BarrierTimeoutError",
    "MainProcessLoggingCallback",
    "NaNGuardCallback",
    "NonFiniteStep",
    "RunSummaryCallback",
    "SavedModelMismatchError",
    "ThroughputCallback",
    "UnwrapAndSaveCallback",
]
