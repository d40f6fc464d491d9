"""Callbacks trainer_ext adds to the Trainer; one per module."""

from .barrier import BarrierCallback, BarrierTimeoutError
from .main_process_logging import MainProcessLoggingCallback
from .nan_guard import NaNGuardCallback, NonFiniteStep
from .run_summary import RunSummaryCallback
from .throughput import ThroughputCallback
from .unwrap_and_save import SavedModelMismatchError, UnwrapAndSaveCallback

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
