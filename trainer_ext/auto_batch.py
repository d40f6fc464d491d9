"""``--auto_find_batch_size`` without accelerate (work in progress: see issue 14, item 6)."""

from __future__ import annotations


class AutoBatchMixin:
    """Mix in before ``transformers.Trainer``: out-of-memory steps are retried at a smaller micro-batch."""
