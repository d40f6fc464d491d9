"""Tier 1: batch sharding, the seeded sampler, the sharded loader's bookkeeping and cheap skipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from trainer_ext.distributed import (
    BatchSamplerShard,
    GradientState,
    SeedableRandomSampler,
    ShardedDataLoader,
    skip_first_batches,
)
from trainer_ext.distributed.data.loader import shard_dataloader
from trainer_ext.errors import ConfigError


class CountingDataset(Dataset):
    """Sample i is the integer i; every ``__getitem__`` is recorded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.calls.append(index)
        return index


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def _original(n: int, b: int, drop_last: bool = False) -> list[list[int]]:
    return list(BatchSampler(SequentialSampler(range(n)), b, drop_last))


def _shards(n: int, b: int, ws: int, drop_last: bool = False, even: bool = True) -> list[BatchSamplerShard]:
    return [
        BatchSamplerShard(BatchSampler(SequentialSampler(range(n)), b, drop_last), ws, r, even_batches=even)
        for r in range(ws)
    ]


def _interleave(per_rank: list[list[list[int]]]) -> list[int]:
    """The global order: round j is rank 0's j-th batch, then rank 1's, …"""
    flat = []
    for j in range(max(len(p) for p in per_rank)):
        for p in per_rank:
            if j < len(p):
                flat += p[j]
    return flat


SIZES = [1, 2, 3, 5, 7, 8, 11, 12, 13, 24, 25]


@pytest.mark.parametrize("ws", [1, 2, 3])
@pytest.mark.parametrize("b", [1, 3, 4])
@pytest.mark.parametrize("n", SIZES)
def test_even_batches(n: int, b: int, ws: int) -> None:
    orig = _original(n, b)
    shards = _shards(n, b, ws)
    per_rank = [list(s) for s in shards]
    expected_count = -(-len(orig) // ws)
    for shard, batches in zip(shards, per_rank, strict=True):
        assert len(batches) == len(shard) == expected_count  # same count on every rank
    for r, batches in enumerate(per_rank):
        for j, batch in enumerate(batches):
            i = r + j * ws
            if i < len(orig):  # rank r gets original batch r + j·W (a short one is completed)
                assert batch[: len(orig[i])] == orig[i]
            if ws > 1:
                assert len(batch) == b  # every rank steps with a full batch
    flat = _interleave(per_rank)
    assert flat[:n] == list(range(n))  # every real sample exactly once, in the one-rank order
    padding = flat[n:]
    assert padding == [k % n for k in range(len(padding))]  # padding repeats the start of the epoch
    if ws > 1:
        assert len(flat) == expected_count * ws * b
    else:
        assert padding == []


@pytest.mark.parametrize("ws", [1, 2, 3])
@pytest.mark.parametrize("n", SIZES)
def test_drop_last(n: int, ws: int) -> None:
    b = 4
    orig = _original(n, b, drop_last=True)
    shards = _shards(n, b, ws, drop_last=True)
    per_rank = [list(s) for s in shards]
    for r, (shard, batches) in enumerate(zip(shards, per_rank, strict=True)):
        assert len(batches) == len(shard) == len(orig) // ws
        assert batches == orig[r : (len(orig) // ws) * ws : ws]
        assert all(len(batch) == b for batch in batches)
    flat = _interleave(per_rank)
    assert flat == list(range(len(flat)))  # nothing repeated, the incomplete last round dropped
    assert len(flat) == (n // (b * ws)) * b * ws


@pytest.mark.parametrize("ws", [1, 2, 3])
@pytest.mark.parametrize("n", SIZES)
def test_uneven_batches(n: int, ws: int) -> None:
    b = 4
    orig = _original(n, b)
    shards = _shards(n, b, ws, even=False)
    per_rank = [list(s) for s in shards]
    for r, (shard, batches) in enumerate(zip(shards, per_rank, strict=True)):
        assert batches == orig[r::ws]
        assert len(shard) == len(batches)
    assert sorted(_interleave(per_rank)) == list(range(n))  # no padding at all


def test_example_from_docstring_short_dataset() -> None:
    """N < b·W: three ranks share one short batch; each gets a full batch cycling the dataset."""
    assert [list(s) for s in _shards(3, 4, 3)] == [[[0, 1, 2, 0]], [[1, 2, 0, 1]], [[2, 0, 1, 2]]]
    assert [list(s) for s in _shards(9, 2, 2)] == [[[0, 1], [4, 5], [8, 0]], [[2, 3], [6, 7], [1, 2]]]


def test_variable_size_batches_repeat_whole_batches() -> None:
    batches = [[0, 1], [2], [3, 4, 5]]
    shards = [BatchSamplerShard(batches, 2, r) for r in range(2)]
    assert [list(s) for s in shards] == [[[0, 1], [3, 4, 5]], [[2], [0, 1]]]
    assert [len(s) for s in shards] == [2, 2]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("ws", [1, 2, 3])
@pytest.mark.parametrize("skip", [0, 1, 2, 10])
def test_skip_batches(skip: int, ws: int, even: bool, drop_last: bool) -> None:
    for shard in _shards(13, 2, ws, drop_last=drop_last, even=even):
        full = list(shard)
        shard.skip_batches = skip
        assert list(shard) == full[skip:]
        assert len(shard) == max(0, len(full) - skip)


@pytest.mark.parametrize("ws", [2, 3])
def test_shard_reads_a_shared_generator_to_the_end_under_drop_last(ws: int) -> None:
    """The dropped last round is still read: a RandomSampler draws its next permutation from the shared generator
    only when it runs out, so each epoch's order depends on it (as in accelerate, which reads the sampler through)."""
    shared, whole = torch.Generator().manual_seed(42), torch.Generator().manual_seed(42)
    shards = [
        BatchSamplerShard(BatchSampler(RandomSampler(range(22), generator=shared), 4, True), ws, r) for r in range(ws)
    ]
    reference = BatchSampler(RandomSampler(range(22), generator=whole), 4, True)
    for _epoch in range(3):
        expected = list(reference)  # 5 batches: the rounds of ws, the rest dropped
        for rank, shard in enumerate(shards):
            generator_before = shared.get_state()
            assert list(shard) == expected[rank : (5 // ws) * ws : ws]
            if rank < ws - 1:
                shared.set_state(generator_before)  # every rank reads the same epoch
        assert torch.equal(shared.get_state(), whole.get_state())


def test_shard_set_epoch_reaches_the_sampler() -> None:
    sampler = SeedableRandomSampler(range(10), seed=3)
    shard = BatchSamplerShard(BatchSampler(sampler, 2, False), 2, 0)
    shard.set_epoch(4)
    assert sampler.epoch == 4


# -- SeedableRandomSampler ---------------------------------------------------------------------------


def test_seedable_sampler_same_seed_same_order() -> None:
    a = SeedableRandomSampler(range(50), seed=7)
    b = SeedableRandomSampler(range(50), seed=7)
    torch.manual_seed(123)  # the global RNG plays no part
    first = list(a)
    torch.manual_seed(456)
    assert list(b) == first
    second = list(a)  # a pass moves the sampler to the next epoch, like a loop that never calls set_epoch
    assert second != first and a.epoch == 2
    a.set_epoch(0)
    assert list(a) == first
    assert sorted(first) == list(range(50))
    assert first != list(range(50))
    assert list(SeedableRandomSampler(range(50), seed=8)) != first


def test_seedable_sampler_epochs() -> None:
    a = SeedableRandomSampler(range(50), seed=7)
    b = SeedableRandomSampler(range(50), seed=7)
    epoch0 = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    epoch1 = list(a)
    assert a.epoch == 2  # advanced by the full pass
    assert epoch1 != epoch0 and sorted(epoch1) == list(range(50))
    assert list(b) == epoch1
    a.set_epoch(0)
    assert list(a) == epoch0


def test_seedable_sampler_ignores_a_given_generator() -> None:
    g = torch.Generator().manual_seed(99)
    assert list(SeedableRandomSampler(range(20), seed=1, generator=g)) == list(
        SeedableRandomSampler(range(20), seed=1)
    )


# -- shard_dataloader / ShardedDataLoader ------------------------------------------------------------


def _prepared(
    dataset: Dataset,
    b: int,
    ws: int = 1,
    rank: int = 0,
    *,
    shuffle: bool = False,
    drop_last: bool = False,
    gs: GradientState | None = None,
    seed: int = 0,
    **kwargs: object,
) -> ShardedDataLoader:
    loader = DataLoader(dataset, batch_size=b, shuffle=shuffle, drop_last=drop_last)
    return shard_dataloader(
        loader,
        num_processes=ws,
        process_index=rank,
        gradient_state=gs or GradientState(),
        seed=seed,
        **kwargs,
    )


def _lists(loader: DataLoader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_shuffled_loader_gets_the_seeded_sampler() -> None:
    ds = CountingDataset(20)
    plain = DataLoader(ds, batch_size=4, shuffle=True)
    loader = shard_dataloader(plain, num_processes=2, process_index=1, gradient_state=GradientState(), seed=11)
    assert isinstance(loader, ShardedDataLoader)
    assert isinstance(loader.batch_sampler, BatchSamplerShard)
    inner = loader.batch_sampler.batch_sampler
    assert type(inner) is BatchSampler and (inner.batch_size, inner.drop_last) == (4, False)
    assert isinstance(inner.sampler, SeedableRandomSampler) and inner.sampler.seed == 11
    assert loader.dataset is ds  # the full dataset, not a shard
    assert len(loader) == 3  # ceil(5 batches / 2 ranks)
    assert loader.total_batch_size == 8


def test_sequential_loader_keeps_its_batch_sampler() -> None:
    plain = DataLoader(CountingDataset(10), batch_size=3)
    loader = shard_dataloader(plain, num_processes=1, process_index=0, gradient_state=GradientState(), seed=0)
    assert loader.batch_sampler.batch_sampler is plain.batch_sampler  # transformers duck-types this
    assert _lists(loader) == _lists(plain)


@pytest.mark.parametrize(
    "kwargs, sampler_type",
    [
        ({"use_seedable_sampler": False}, RandomSampler),
        ({}, SeedableRandomSampler),
    ],
)
def test_use_seedable_sampler_flag(kwargs: dict, sampler_type: type) -> None:
    loader = _prepared(CountingDataset(10), 2, shuffle=True, **kwargs)
    assert type(loader.batch_sampler.batch_sampler.sampler) is sampler_type


def test_loader_options_are_kept() -> None:
    plain = DataLoader(CountingDataset(7), batch_size=3, collate_fn=sum, drop_last=True, timeout=0)
    loader = shard_dataloader(plain, num_processes=1, process_index=0, gradient_state=GradientState(), seed=0)
    assert loader.collate_fn is sum and loader.batch_sampler.drop_last is True
    assert list(loader) == [0 + 1 + 2, 3 + 4 + 5]


def test_sampler_with_replacement_is_kept() -> None:
    ds = CountingDataset(10)
    plain = DataLoader(ds, batch_size=2, sampler=RandomSampler(ds, replacement=True))
    loader = shard_dataloader(plain, num_processes=1, process_index=0, gradient_state=GradientState(), seed=0)
    assert loader.batch_sampler.batch_sampler is plain.batch_sampler


def test_ranks_partition_a_shuffled_epoch() -> None:
    ds = CountingDataset(24)
    per_rank = [_lists(_prepared(ds, 4, 3, r, shuffle=True, seed=5)) for r in range(3)]
    one_rank = _lists(_prepared(ds, 12, 1, 0, shuffle=True, seed=5))
    flat = _interleave(per_rank)
    assert sorted(flat) == list(range(24))
    assert flat == [i for batch in one_rank for i in batch]  # W ranks × b == one rank × W·b


def test_set_epoch_reshuffles_the_same_way_on_every_rank() -> None:
    ds = CountingDataset(16)
    loaders = [_prepared(ds, 4, 2, r, shuffle=True, seed=5) for r in range(2)]
    epoch0 = [_lists(dl) for dl in loaders]
    for dl in loaders:
        dl.set_epoch(1)
    epoch1 = [_lists(dl) for dl in loaders]
    assert epoch1 != epoch0
    assert sorted(_interleave(epoch1)) == list(range(16))


def test_already_sharded_loader_is_returned_as_is() -> None:
    loader = _prepared(CountingDataset(4), 2)
    assert shard_dataloader(loader, num_processes=2, process_index=0, gradient_state=GradientState(), seed=0) is loader


def test_iterable_dataset() -> None:
    plain = DataLoader(Stream(), batch_size=2)
    tracked = shard_dataloader(plain, num_processes=1, process_index=0, gradient_state=GradientState(), seed=0)
    assert tracked.dataset is plain.dataset and tracked.batch_size == 2
    assert [b.tolist() for b in tracked] == [b.tolist() for b in plain]
    # several processes: every rank reads the stream and keeps its share (no longer refused)
    ranks = [
        shard_dataloader(plain, num_processes=2, process_index=r, gradient_state=GradientState(), seed=0)
        for r in range(2)
    ]
    assert [[b.tolist() for b in dl] for dl in ranks] == [[[0, 1]], [[2, 3]]]


@pytest.mark.parametrize(
    "n, b, ws, rank, remainder",
    [
        (10, 4, 1, 0, 2),
        (8, 4, 1, 0, 0),
        (10, 2, 2, 1, 2),
        (12, 2, 3, 2, 0),
        (5, 4, 2, 1, 5),
        (13, 3, 3, 0, 4),
    ],
)
def test_end_of_dataloader_and_remainder(n: int, b: int, ws: int, rank: int, remainder: int) -> None:
    gs = GradientState()
    loader = _prepared(CountingDataset(n), b, ws, rank, gs=gs)
    assert loader.remainder == remainder
    seen = []
    for _ in loader:
        assert gs.active_dataloader is loader and gs.in_dataloader
        seen.append((gs.end_of_dataloader, gs.remainder))
    assert len(seen) == len(loader) == math.ceil(math.ceil(n / b) / ws)
    assert seen == [(False, remainder)] * (len(seen) - 1) + [(True, remainder)]
    assert gs.active_dataloader is None and not gs.in_dataloader
    assert gs.end_of_dataloader is False and gs.remainder == -1


def test_remainder_unknown_with_drop_last() -> None:
    assert _prepared(CountingDataset(10), 4, drop_last=True).remainder == -1


def test_nested_iteration_restores_the_outer_loader() -> None:
    gs = GradientState()
    outer = _prepared(CountingDataset(6), 2, gs=gs)  # 3 batches, remainder 0
    inner = _prepared(CountingDataset(3), 2, gs=gs)  # 2 batches, remainder 1
    trace = []
    for step, _ in enumerate(outer):
        inner_trace = []
        for _ in inner:
            assert gs.active_dataloader is inner
            inner_trace.append((gs.end_of_dataloader, gs.remainder))
        assert inner_trace == [(False, 1), (True, 1)]
        if step == 0:
            for _ in inner:
                break  # an abandoned inner loop also gives the outer loader back
        assert gs.active_dataloader is outer
        trace.append((gs.end_of_dataloader, gs.remainder))
    assert trace == [(False, 0), (False, 0), (True, 0)]
    assert gs.active_dataloader is None


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("ws, rank", [(1, 0), (2, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("k", [0, 1, 3, 100])
def test_skip_first_batches(k: int, ws: int, rank: int, shuffle: bool) -> None:
    ds = CountingDataset(23)
    gs = GradientState()
    loader = _prepared(ds, 2, ws, rank, shuffle=shuffle, gs=gs, seed=3)
    loader.set_epoch(0)
    full = _lists(loader)
    skipped = skip_first_batches(loader, k)
    skipped.set_epoch(0)  # what the Trainer does before iterating the resumed epoch
    assert isinstance(skipped, ShardedDataLoader)
    assert skipped.dataset is ds and skipped.remainder == loader.remainder
    assert len(skipped) == max(0, len(full) - k)
    ds.calls.clear()
    ends = []
    got = []
    for batch in skipped:
        got.append(batch.tolist())
        ends.append(gs.end_of_dataloader)
    assert got == full[k:]
    assert ends == [False] * (len(got) - 1) + [True] * bool(got)
    assert sorted(ds.calls) == sorted(i for batch in full[k:] for i in batch)  # skipped samples never loaded
    loader.set_epoch(0)
    assert _lists(loader) == full  # the original loader is unchanged


def test_skip_twice_accumulates() -> None:
    loader = _prepared(CountingDataset(20), 2)
    full = _lists(loader)
    assert _lists(skip_first_batches(skip_first_batches(loader, 2), 3)) == full[5:]


def test_skip_first_batches_plain_loader() -> None:
    plain = DataLoader(CountingDataset(10), batch_size=3)
    skipped = skip_first_batches(plain, 2)
    assert len(skipped) == 2
    assert _lists(skipped) == [[6, 7, 8], [9]]
    assert skipped.batch_size == 3  # attributes reach the wrapped loader


def test_batches_placed_on_the_device() -> None:
    loader = _prepared(CountingDataset(4), 2, device=torch.device("meta"))
    assert [batch.device.type for batch in loader] == ["meta", "meta"]


@pytest.mark.parametrize("n", [1, 5, 23, 24, 40])
@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("ws", [1, 2, 3])
@pytest.mark.parametrize("drop_last, even", [(False, True), (True, True), (False, False)])
def test_sliced_resume_path_yields_the_same_batches(n: int, b: int, ws: int, drop_last: bool, even: bool) -> None:
    """The O(1)-in-position skip path cuts the same global batches the iterating path produces."""
    from torch.utils.data import BatchSampler, SequentialSampler

    from trainer_ext.distributed.data.loader import BatchSamplerShard

    shard = BatchSamplerShard(BatchSampler(SequentialSampler(range(n)), b, drop_last), ws, 0, even_batches=even)
    assert list(shard._sliced_batches(0)) == list(shard._global_batches())


def test_resume_does_not_walk_through_the_skipped_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_ext.distributed.data.loader import BatchSamplerShard

    loader = _prepared(CountingDataset(100), 4, 2, 1, shuffle=True, seed=1)
    loader.set_epoch(0)
    full = _lists(loader)

    def walk(self):
        raise AssertionError("the skipped batches were iterated")

    monkeypatch.setattr(BatchSamplerShard, "_global_batches", walk)
    skipped = skip_first_batches(loader, 5)
    skipped.set_epoch(0)
    assert _lists(skipped) == full[5:]


def test_split_shard_needs_a_batch_size_divisible_by_the_processes() -> None:
    with pytest.raises(ConfigError, match="multiple of 3"):
        BatchSamplerShard(BatchSampler(SequentialSampler(range(10)), 4, False), 3, 0, split_batches=True)
