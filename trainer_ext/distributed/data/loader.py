"""Dataloader sharding: seeded sampler, round-robin batches per rank, even last round, cheap skipping.

Rank r of W receives batches r, r+W, r+2W, … of the original loader, so W ranks with batch b see the
same samples in the same order as one rank with batch W·b; with ``split_batches`` every rank gets its
contiguous 1/W of each batch instead. The last round is completed with samples from the start of the epoch
(every rank steps the same number of times); ``remainder`` tells ``gather_for_metrics`` how many of the
last gathered rows are real, so evaluation drops the padding. Skipping batches on resume works on indices
only: no sample is loaded or collated to be thrown away. :func:`shard_dataloader` picks the loader:
this one, a dispatching one (``dispatch.py``) or, for iterable datasets, a stream shard (``iterable.py``).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from trainer_ext.distributed.accumulation import GradientState
from trainer_ext.distributed.data.dispatch_batches import DispatchedDataLoader
from trainer_ext.distributed.data.iterable import IterableDatasetShard, IterableShardLoader
from trainer_ext.distributed.data.prepared import IteratedPosition, TrackedDataLoader, TrackedIteration
from trainer_ext.distributed.data.shuffle import PassOrder, give_generator, synchronize_rng_states
from trainer_ext.distributed.data.split import check_split
from trainer_ext.errors import ConfigError

__all__ = [
    "BatchSamplerShard",
    "DispatchedDataLoader",
    "IterableShardLoader",
    "SeedableRandomSampler",
    "ShardedDataLoader",
    "TrackedDataLoader",
    "shard_dataloader",
    "skip_first_batches",
]

logger = logging.getLogger(__name__)


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
    """This rank's share of an existing batch sampler (``.batch_sampler`` keeps the original).

    Whole batches in turn, or with ``split_batches`` the rank's contiguous slice of every batch (the batch size
    must then be a multiple of the number of processes).
    """

    def __init__(
        self,
        batch_sampler: Any,
        num_processes: int,
        process_index: int,
        even_batches: bool = True,
        split_batches: bool = False,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.even_batches = even_batches
        self.split_batches = split_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        if split_batches:
            check_split(self.batch_size, num_processes, split_batches)
        self.skip_batches = 0
        self.pending_skip = 0  # one-shot: skipped by the next pass only (resume from a saved position)
        self.order = PassOrder()  # a plain RandomSampler's order: recorded per pass, restored on resume
        self.resumes_mid_pass = False  # the next pass continues a saved one: its start already drew its seeds

    def _total_batches(self) -> int:
        return len(self.batch_sampler)

    @property
    def _round(self) -> int:
        """Original batches per round of the ranks: one when each is split among them."""
        return 1 if self.split_batches else self.num_processes

    def __len__(self) -> int:
        total, ws = self._total_batches(), self.num_processes
        if ws == 1 or self.split_batches:
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
        ws = self._round
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
        if self.num_processes == 1 or not self.even_batches or self.drop_last:
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
        bs, ws = self.batch_size, self._round
        n_batches = len(indices) // bs if self.drop_last else -(-len(indices) // bs)
        if self.num_processes > 1 and self.even_batches and not self.drop_last:
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
        batches = self._sliced_batches(skip * self._round) if fast else self._global_batches()
        batches = self.order.batches(self.batch_sampler, batches)
        if self.split_batches:
            yield from self._split(batches, 0 if fast else skip)
            return
        mine = skip if fast else 0
        rounds = self._total_batches() // ws if ws > 1 and self.drop_last else None
        for i, batch in enumerate(batches, start=skip * ws if fast else 0):
            # past the last whole round (drop_last), read on without yielding, as accelerate does: a RandomSampler
            # draws its next permutation from the shared generator only when it runs out, and the next epoch's
            # order depends on that draw
            if ws > 1 and i % ws != rank or rounds is not None and i // ws >= rounds:
                continue
            if mine >= skip:
                yield batch
            mine += 1

    def _split(self, batches: Iterator[list[int]], skip: int) -> Iterator[list[int]]:
        """This rank's slice of each batch after the first ``skip``; a short uneven last batch may leave none."""
        per = self.batch_size // self.num_processes
        for i, batch in enumerate(batches):
            part = batch[self.process_index * per : (self.process_index + 1) * per]
            if i >= skip and part:
                yield part

    def set_epoch(self, epoch: int) -> None:
        for obj in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)


class ShardedDataLoader(TrackedIteration, DataLoader):
    """A DataLoader over a :class:`BatchSamplerShard` that tells the gradient state where it is.

    ``len()`` is the number of batches on this rank; ``.dataset`` is the full dataset. ``synchronize`` runs at the
    start of every pass (accelerate's ``rng_types``: the processes take the main process's RNG states).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        shard: BatchSamplerShard,
        gradient_state: GradientState,
        device: torch.device | None = None,
        synchronize: Callable[[], None] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, batch_sampler=shard, **loader_kwargs)
        self._loader_kwargs = loader_kwargs
        self.gradient_state = gradient_state
        self.device = device
        self.synchronize = synchronize
        self.end_of_dataloader = False
        self._reader: ShardedDataLoader | None = None  # the skipping copy reading this loader's epoch, if any
        total = len(dataset) if hasattr(dataset, "__len__") else -1
        if shard.drop_last or self.total_batch_size is None or total < 0:
            self.remainder = -1
        else:
            self.remainder = total % self.total_batch_size

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all ranks: the original batch size, times the ranks unless it is split."""
        shard = self.batch_sampler
        if shard.batch_size is None:
            return None
        return shard.batch_size if shard.split_batches else shard.batch_size * shard.num_processes

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        sampler = getattr(self.batch_sampler.batch_sampler, "sampler", None)
        return int(getattr(sampler, "epoch", 0))

    def _on_iter_start(self) -> None:
        if self.synchronize is not None:
            self.synchronize()
        parent = self.__dict__.get("_parent")
        if parent is not None:
            parent._reader = self  # its position is now this pass's
        self._reader = None
        self._iter_epoch = self.epoch
        self._iter_skip = self.batch_sampler.skip_batches + self.batch_sampler.pending_skip

    def _source(self) -> Iterator[Any]:
        shard = self.batch_sampler
        if not shard.resumes_mid_pass:
            return super()._source()
        # The interrupted run drew this pass's seeds from the global RNG (the DataLoader's base seed, a plain
        # sampler's seed) before it saved, and the checkpoint restored the RNG after those draws: draw nothing now.
        shard.resumes_mid_pass = False
        state = torch.get_rng_state()
        iterator = super()._source()
        torch.set_rng_state(state)
        return iterator

    def _on_iter_end(self) -> None:
        """A finished pass moves a seedable sampler to the next epoch even when the pass stopped before the sampler
        ran out (``drop_last`` rounds): every epoch gets its own order, as accelerate's ``set_epoch`` per pass does."""
        sampler = getattr(self.batch_sampler.batch_sampler, "sampler", None)
        if hasattr(sampler, "set_epoch") and self.epoch == self._iter_epoch:
            self.batch_sampler.set_epoch(self._iter_epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch being read, the batches of it already handed out (on this rank, and in
        unsharded batches), and what the pass's shuffle order started from (a plain ``RandomSampler``)."""
        if self._reader is not None:  # a skip_first_batches copy is reading this epoch
            return self._reader.state_dict()
        shard = self.batch_sampler
        started = hasattr(self, "_iter_epoch")
        if not started:
            position = {"epoch": self.epoch, "batches": shard.pending_skip}
        elif self.end_of_dataloader:  # a finished pass: the next one starts the next epoch
            position = {"epoch": self._iter_epoch + 1, "batches": 0}
        else:
            position = {"epoch": self._iter_epoch, "batches": self._iter_skip + self.batches_yielded}
        position["global_batches"] = position["batches"] * shard._round
        position["processes"] = shard.num_processes
        order = shard.order.state(shard.batch_sampler, started, started and self.end_of_dataloader)
        return {**position, **order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: same epoch and order; the next pass skips the batches already seen (by index).

        A position saved by another number of processes is translated through its unsharded batch count.
        """
        shard = self.batch_sampler
        self.set_epoch(int(state["epoch"]))
        batches = int(state["batches"])
        if "global_batches" in state and int(state.get("processes", shard.num_processes)) != shard.num_processes:
            batches, repeated = divmod(int(state["global_batches"]), shard._round)
            if repeated:
                logger.warning(
                    "load_state: the position was saved by %s processes; on %s, the last %s of its batches are "
                    "read again",
                    state["processes"],
                    shard.num_processes,
                    repeated,
                )
        shard.pending_skip = batches
        shard.resumes_mid_pass = batches > 0
        shard.order.restore(state)
        for name in ("_iter_epoch", "_iter_skip"):
            self.__dict__.pop(name, None)
        self._reader = None

    def skip(self, num_batches: int) -> ShardedDataLoader:
        """A loader identical to this one that starts after its first ``num_batches`` batches (this rank).

        It replaces a position restored by ``load_state`` (accelerate's resume calls both: the batches are skipped
        once, not twice) and takes its shuffle order; this loader's next pass then starts a new epoch in full.
        """
        shard = copy.copy(self.batch_sampler)
        shard.skip_batches = self.batch_sampler.skip_batches + int(num_batches)
        shard.pending_skip = 0
        shard.order = PassOrder()
        shard.order.restore(self.batch_sampler.order.hand_over())
        shard.resumes_mid_pass, self.batch_sampler.resumes_mid_pass = self.batch_sampler.resumes_mid_pass, False
        self.batch_sampler.pending_skip = 0
        loader = ShardedDataLoader(
            self.dataset,
            shard=shard,
            gradient_state=self.gradient_state,
            device=self.device,
            synchronize=self.synchronize,
            **self._loader_kwargs,
        )
        loader.remainder = self.remainder
        loader._parent = self
        return loader


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
    split_batches: bool = False,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    use_seedable_sampler: bool = True,
    rng_types: list[str] | None = None,
    comm_device: torch.device | None = None,
) -> DataLoader:
    """Rebuild ``dataloader`` as this rank's loader, with accelerate's meaning of the options.

    ``dispatch_batches`` (rank 0 reads, the others receive) defaults to True for an iterable dataset when
    batches are placed on a device, False otherwise; it ignores ``even_batches`` (its last batch is always
    completed). Iterable datasets not dispatched are read by every rank, each keeping its share. Without
    ``use_seedable_sampler`` a shuffling sampler on several processes gets a generator seeded now, and each pass
    starts from the main process's state of the RNGs in ``rng_types`` (``"generator"``: that generator).
    """
    if isinstance(dataloader, TrackedIteration):
        return dataloader
    iterable = isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches is None:
        dispatch_batches = iterable and device is not None
    elif dispatch_batches and device is None:
        raise ConfigError(
            "dispatch_batches=True broadcasts the batches from the main process, so they must be placed on the "
            "device: turn device placement on, or set dispatch_batches=False"
        )
    batch_sampler = None if iterable else dataloader.batch_sampler
    check_split(getattr(batch_sampler, "batch_size", dataloader.batch_size), num_processes, split_batches)
    kwargs = {k: getattr(dataloader, k) for k in _LOADER_KEYS if hasattr(dataloader, k)}
    if device is None or device.type != "cuda":
        kwargs["pin_memory"] = False  # pinning needs an accelerator; avoids torch's warning on CPU
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    common = {"gradient_state": gradient_state, "device": device}
    if iterable and num_processes == 1:
        return TrackedDataLoader(
            dataloader.dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last, **common, **kwargs
        )
    if batch_sampler is not None:
        batch_sampler = _seeded(batch_sampler, seed) if use_seedable_sampler else batch_sampler
    if dispatch_batches and num_processes > 1:
        kwargs.pop("generator", None)
        rows = {"batch_sampler": batch_sampler} if batch_sampler is not None else {"batch_size": dataloader.batch_size}
        return DispatchedDataLoader(
            dataloader.dataset,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=split_batches,
            drop_last=bool(getattr(batch_sampler, "drop_last", dataloader.drop_last)),
            **rows,
            **common,
            **kwargs,
        )
    if iterable:
        if dataloader.batch_size is None:
            raise ConfigError(
                "an iterable dataset read by every process needs a batch_size on its DataLoader; set one, or "
                "set dispatch_batches=True"
            )
        shard = IterableDatasetShard(
            dataloader.dataset,
            dataloader.batch_size,
            num_processes=num_processes,
            process_index=process_index,
            drop_last=dataloader.drop_last,
            split_batches=split_batches,
        )
        return IterableShardLoader(shard, **common, **kwargs)
    synchronize = None
    if num_processes > 1:
        generator = None if use_seedable_sampler else give_generator(batch_sampler)
        kinds = [kind for kind in rng_types or [] if kind != "generator" or generator is not None]
        if kinds:
            place = comm_device or device or torch.device("cpu")
            synchronize = functools.partial(synchronize_rng_states, kinds, generator, place)
    shard = BatchSamplerShard(
        batch_sampler, num_processes, process_index, even_batches=even_batches, split_batches=split_batches
    )
    return ShardedDataLoader(dataloader.dataset, shard=shard, synchronize=synchronize, **common, **kwargs)


def _seeded(batch_sampler: Any, seed: int) -> Any:
    """A plain shuffling batch sampler rebuilt on :class:`SeedableRandomSampler` (same order on every rank)."""
    sampler = getattr(batch_sampler, "sampler", None)
    if type(batch_sampler) is BatchSampler and type(sampler) is RandomSampler and not sampler.replacement:
        seeded = SeedableRandomSampler(sampler.data_source, seed=seed, num_samples=sampler._num_samples)
        return BatchSampler(seeded, batch_sampler.batch_size, batch_sampler.drop_last)
    return batch_sampler


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """Skip this rank's first ``num_batches`` batches: by index for a sharded loader (nothing is loaded), by
    reading them for the others (dispatched or iterable loaders: every rank still takes part in each batch).

    On a prepared loader it replaces the position ``load_state`` restored, so the batches are skipped once."""
    if isinstance(dataloader, (ShardedDataLoader, IteratedPosition)):
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
