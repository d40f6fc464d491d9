"""Iterable datasets read by every rank (accelerate's ``IterableDatasetShard``, ``dispatch_batches=False``).

Every rank reads the whole stream, groups it in global batches of ``W·b`` samples (``b`` with
``split_batches``) and keeps its contiguous share of each. A short last group is kept unless ``drop_last``: as
in accelerate, it is completed to a whole group by repeating the epoch's first group (or itself, when it is the
first), so every rank gets a full batch. Each sample travels with the number of real samples in its group, so that the
loader knows ``remainder`` even when worker processes read the stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from trainer_ext.distributed.accumulation import GradientState
from trainer_ext.distributed.data.prepared import IteratedPosition, TrackedIteration
from trainer_ext.distributed.data.split import check_split


class IterableDatasetShard(IterableDataset):
    """This rank's samples of an iterable dataset, each as ``(sample, real samples in its global batch)``."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        num_processes: int,
        process_index: int,
        drop_last: bool = False,
        split_batches: bool = False,
    ) -> None:
        check_split(batch_size, num_processes, split_batches)
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.process_index = process_index
        self.drop_last = drop_last
        self.split_batches = split_batches
        self.global_batch_size = batch_size if split_batches else batch_size * num_processes
        self.per_rank = self.global_batch_size // num_processes

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        """Samples on this rank (a ``TypeError`` when the stream has no length, as for any iterable)."""
        full, k = divmod(len(self.dataset), self.global_batch_size)
        return (full + int(bool(k) and not self.drop_last)) * self.per_rank

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        size, rank = self.global_batch_size, self.process_index
        mine = slice(rank * self.per_rank, (rank + 1) * self.per_rank)
        first: list[Any] = []  # the epoch's first group: padding for a short last group
        group: list[Any] = []
        for sample in self.dataset:
            group.append(sample)
            if len(group) == size:
                first = first or group
                yield from ((s, size) for s in group[mine])
                group = []
        if not group or self.drop_last:
            return
        k = len(group)
        first = first or list(group)
        while len(group) < size:
            group += first
        yield from ((s, k) for s in group[mine])


class _TaggedCollate:
    """Collate the samples of a batch and pass on their group's real count (picklable for worker processes)."""

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn or default_collate

    def __call__(self, items: list[tuple[Any, int]]) -> tuple[Any, int]:
        return self.collate_fn([sample for sample, _ in items]), items[0][1]


class IterableShardLoader(IteratedPosition, TrackedIteration, DataLoader):
    """A DataLoader over an :class:`IterableDatasetShard`: batches of ``per_rank`` samples of this rank's share."""

    def __init__(
        self,
        shard: IterableDatasetShard,
        *,
        gradient_state: GradientState,
        device: torch.device | None = None,
        collate_fn: Any = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(
            shard, batch_size=shard.per_rank, drop_last=False, collate_fn=_TaggedCollate(collate_fn), **loader_kwargs
        )
        self.gradient_state = gradient_state
        self.device = device
        self.end_of_dataloader = False
        self.remainder = -1

    @property
    def total_batch_size(self) -> int:
        return self.dataset.global_batch_size

    def _source(self) -> Iterator[Any]:
        for batch, real in super()._source():
            self.remainder = real
            yield batch
