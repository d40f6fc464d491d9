"""Dataloader sharding: seeded sampler, round-robin batches per rank, even last round, cheap skipping.

Rank r of W receives batches r, r+W, r+2W, … of the original loader, so W ranks with batch b see the
same samples in the same order as one rank with batch W·b. The last round is completed with samples
from the start of the epoch (every rank steps the same number of times); ``remainder`` tells
``gather_for_metrics`` how many of the last gathered rows are real, so evaluation drops the padding.
Skipping batches on resume works on indices only: no sample is loaded or collated to be thrown away.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from ..errors import ConfigError
from .accumulation import GradientState
from .collectives import send_to_device


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order depends only on ``seed + epoch``: identical on every rank."""

    def __init__(self, data_source: Any, seed: int, **kwargs: Any) -> None:
        kwargs.pop("generator", None)
        super().__init__(data_source, generator=torch.Generator(), **kwargs)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        self.generator.manual_seed(self.seed + self.epoch)
        yield from super().__iter__()
        self.epoch += 1  # a loop that never calls set_epoch still gets a new order next pass


class BatchSamplerShard:
    """This rank's share of an existing batch sampler (``.batch_sampler`` keeps the original)."""

    def __init__(self, batch_sampler: Any, num_processes: int, process_index: int, even_batches: bool = True) -> None:
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self.skip_batches = 0
        self.pending_skip = 0  # one-shot: skipped by the next pass only (resume from a saved position)

    def _total_batches(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        total, ws = self._total_batches(), self.num_processes
        if ws == 1:
            n = total
        elif self.drop_last:
            n = total // ws
        elif self.even_batches:
            n = -(-total // ws)
        else:
            n = total // ws + int(self.process_index < total % ws)
        return max(0, n - self.skip_batches)

    def _global_batches(self) -> Iterator[list[int]]:
        """The original batches; with ``even_batches`` the last round is completed from the epoch's head."""
        ws = self.num_processes
        first: list[list[int]] = []  # the first round, source of the padding
        count = 0
        short: list[int] = []
        for batch in self.batch_sampler:
            batch = list(batch)
            if len(first) < ws:
                first.append(batch)
            if self.batch_size is not None and len(batch) < self.batch_size:
                short = batch  # only the last batch can be short
                break
            count += 1
            yield batch
        if ws == 1 or not self.even_batches or self.drop_last:
            if short:
                yield short
            return
        if count % ws == 0 and not short:
            return
        if self.batch_size is None:  # variable-size batches: repeat whole batches of the first round
            i = 0
            while count % ws != 0:
                yield first[i % len(first)]
                i, count = i + 1, count + 1
            return
        head = [index for batch in first for index in batch]
        cursor, pending = 0, short
        while count % ws != 0 or pending:
            need = self.batch_size - len(pending)
            yield pending + [head[(cursor + k) % len(head)] for k in range(need)]
            cursor, pending, count = cursor + need, [], count + 1

    def _sliced_batches(self, start: int) -> Iterator[list[int]]:
        """Global batches from number ``start`` on, cut straight out of the epoch's index list.

        Same batches as :meth:`_global_batches`, but resuming at batch 900,000 costs what resuming at
        batch 10 costs: one pass of the sampler, no Python loop over the skipped batches.
        """
        indices = list(self.batch_sampler.sampler)
        bs, ws = self.batch_size, self.num_processes
        n_batches = len(indices) // bs if self.drop_last else -(-len(indices) // bs)
        if ws > 1 and self.even_batches and not self.drop_last:
            # complete the short last batch and the unfinished last round from the epoch's head
            n_batches = -(-n_batches // ws) * ws
            head = indices[: ws * bs]
            indices = indices + [head[k % len(head)] for k in range(n_batches * bs - len(indices))]
        for g in range(start, n_batches):
            yield indices[g * bs : (g + 1) * bs]

    def __iter__(self) -> Iterator[list[int]]:
        ws, rank = self.num_processes, self.process_index
        skip, self.pending_skip = self.skip_batches + self.pending_skip, 0
        fast = skip > 0 and type(self.batch_sampler) is BatchSampler and self.batch_size is not None
        batches = self._sliced_batches(skip * ws) if fast else self._global_batches()
        mine = skip if fast else 0
        rounds = self._total_batches() // ws if ws > 1 and self.drop_last else None
        for i, batch in enumerate(batches, start=skip * ws if fast else 0):
            if ws > 1 and i % ws != rank:
                continue
            if rounds is not None and i // ws >= rounds:
                return
            if mine >= skip:
                yield batch
            mine += 1

    def set_epoch(self, epoch: int) -> None:
        for obj in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)


class _TrackedIteration:
    """Look one batch ahead so ``end_of_dataloader`` is True while the last batch is in use, and tell the
    gradient state which loader is active (an evaluation inside a training epoch has its own state)."""

    gradient_state: GradientState
    device: torch.device | None
    end_of_dataloader: bool
    remainder: int

    def _on_iter_start(self) -> None:
        """Hook for loaders that remember where a pass started."""

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader = False
        self.batches_yielded = 0
        self._on_iter_start()
        self.gradient_state._add_dataloader(self)
        try:
            iterator = super().__iter__()  # type: ignore[misc]
            try:
                current = next(iterator)
            except StopIteration:
                return
            while True:
                try:
                    upcoming = next(iterator)
                except StopIteration:
                    self.end_of_dataloader = True
                    self.batches_yielded += 1
                    yield self._place(current)
                    return
                self.batches_yielded += 1
                yield self._place(current)
                current = upcoming
        finally:
            self.gradient_state._remove_dataloader(self)

    def _place(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        return send_to_device(batch, self.device, non_blocking=self.pin_memory)


class ShardedDataLoader(_TrackedIteration, DataLoader):
    """A DataLoader over a :class:`BatchSamplerShard` that tells the gradient state where it is.

    ``len()`` is the number of batches on this rank; ``.dataset`` is the full dataset.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        shard: BatchSamplerShard,
        gradient_state: GradientState,
        device: torch.device | None = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, batch_sampler=shard, **loader_kwargs)
        self._loader_kwargs = loader_kwargs
        self.gradient_state = gradient_state
        self.device = device
        self.end_of_dataloader = False
        bs = shard.batch_size
        total = len(dataset) if hasattr(dataset, "__len__") else -1
        if shard.drop_last or bs is None or total < 0:
            self.remainder = -1
        else:
            self.remainder = total % (bs * shard.num_processes)

    @property
    def total_batch_size(self) -> int | None:
        bs = self.batch_sampler.batch_size
        return None if bs is None else bs * self.batch_sampler.num_processes

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        sampler = getattr(self.batch_sampler.batch_sampler, "sampler", None)
        return int(getattr(sampler, "epoch", 0))

    def _on_iter_start(self) -> None:
        self._iter_epoch = self.epoch
        self._iter_skip = self.batch_sampler.skip_batches + self.batch_sampler.pending_skip

    def state_dict(self) -> dict[str, int]:
        """Where this rank is: the epoch being read and the batches of it already handed out."""
        if not hasattr(self, "_iter_epoch"):
            return {"epoch": self.epoch, "batches": self.batch_sampler.pending_skip}
        if self.end_of_dataloader:  # a finished pass: the next one starts the next epoch
            return {"epoch": self._iter_epoch + 1, "batches": 0}
        return {"epoch": self._iter_epoch, "batches": self._iter_skip + self.batches_yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``: same epoch order; the next pass skips the batches already seen (by index)."""
        self.set_epoch(int(state["epoch"]))
        self.batch_sampler.pending_skip = int(state["batches"])
        for name in ("_iter_epoch", "_iter_skip"):
            self.__dict__.pop(name, None)

    def skip(self, num_batches: int) -> ShardedDataLoader:
        """A loader identical to this one that starts after its first ``num_batches`` batches (this rank)."""
        shard = copy.copy(self.batch_sampler)
        shard.skip_batches = self.batch_sampler.skip_batches + int(num_batches)
        loader = ShardedDataLoader(
            self.dataset,
            shard=shard,
            gradient_state=self.gradient_state,
            device=self.device,
            **self._loader_kwargs,
        )
        loader.remainder = self.remainder
        return loader


class TrackedDataLoader(_TrackedIteration, DataLoader):
    """An unsharded loader (an iterable dataset on one process) that still reports where it is."""

    def __init__(
        self, dataset: Any, *, gradient_state: GradientState, device: torch.device | None = None, **kwargs: Any
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.gradient_state = gradient_state
        self.device = device
        self.end_of_dataloader = False
        self.remainder = -1


_LOADER_KEYS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def shard_dataloader(
    dataloader: DataLoader,
    *,
    num_processes: int,
    process_index: int,
    gradient_state: GradientState,
    seed: int,
    device: torch.device | None = None,
    even_batches: bool = True,
    use_seedable_sampler: bool = True,
) -> DataLoader:
    """Rebuild ``dataloader`` as this rank's :class:`ShardedDataLoader` (iterable datasets unsupported)."""
    if isinstance(dataloader, (ShardedDataLoader, TrackedDataLoader)):
        return dataloader
    kwargs = {k: getattr(dataloader, k) for k in _LOADER_KEYS if hasattr(dataloader, k)}
    if device is None or device.type != "cuda":
        kwargs["pin_memory"] = False  # pinning needs an accelerator; avoids torch's warning on CPU
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    if isinstance(dataloader.dataset, IterableDataset):
        check_shardable(dataloader.dataset, num_processes)
        return TrackedDataLoader(
            dataloader.dataset,
            gradient_state=gradient_state,
            device=device,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **kwargs,
        )
    batch_sampler = dataloader.batch_sampler
    sampler = getattr(batch_sampler, "sampler", None)
    if (
        use_seedable_sampler
        and type(batch_sampler) is BatchSampler
        and type(sampler) is RandomSampler
        and not sampler.replacement
    ):
        seeded = SeedableRandomSampler(sampler.data_source, seed=seed, num_samples=sampler._num_samples)
        batch_sampler = BatchSampler(seeded, batch_sampler.batch_size, batch_sampler.drop_last)
    shard = BatchSamplerShard(batch_sampler, num_processes, process_index, even_batches=even_batches)
    return ShardedDataLoader(dataloader.dataset, shard=shard, gradient_state=gradient_state, device=device, **kwargs)


def check_shardable(dataset: Any, num_processes: int) -> None:
    """Iterable datasets are not split across processes yet: refuse them on several ranks, up front."""
    if num_processes > 1 and isinstance(dataset, IterableDataset):
        raise ConfigError(
            "iterable datasets are not sharded across processes yet; convert it to a map-style dataset "
            "(e.g. datasets.Dataset) for multi-process training"
        )


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """Skip this rank's first ``num_batches`` batches without loading them (resume mid-epoch)."""
    if isinstance(dataloader, ShardedDataLoader):
        return dataloader.skip(num_batches)
    import itertools

    class _Skipped:
        def __init__(self, inner: Any, n: int) -> None:
            self.inner, self.n = inner, n

        def __iter__(self) -> Iterator[Any]:
            return itertools.islice(iter(self.inner), self.n, None)

        def __len__(self) -> int:
            return max(0, len(self.inner) - self.n)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    return _Skipped(dataloader, num_batches)
