"""Tokens per sequence: the block size of a causal LM, the longest of a sample of a classifier's examples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LENGTH_SAMPLE = 10_000  # examples read to find a classifier's longest sequence


def sample_column(dataset: Any, column: str) -> list:
    """``column`` of the first :data:`LENGTH_SAMPLE` examples of a datasets.Dataset."""
    return list(dataset.select(range(min(len(dataset), LENGTH_SAMPLE))).with_format(None)[column])


def sequence_length(args: Any, lengths: Sequence[int] | None) -> int:
    """The block size of a causal LM; a classifier's longest sampled example (padded per batch), at most the
    block size."""
    if args.task != "sequence-classification" or not lengths:
        return args.max_seq_length
    return min(args.max_seq_length, max(lengths))
