"""Callbacks trainer_ext adds to the Trainer; one per module."""

from .run_summary import RunSummaryCallback

__all__ = ["RunSummaryCallback"]
