"""Tier 1: split_batches, dispatch_batches and iterable datasets in one process (ranks simulated by index).

Every rank's loader is built in this process with its own ``process_index``; what the ranks receive together
is compared with what one process with the global batch receives. Dispatching needs a process group for the
other ranks, so here only rank 0's side of it is run (the 2-rank runs are in tests/distributed).
"""

from __future__ import annotations

import math
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from transformers import BatchEncoding

from tests.distributed.split_dispatch_job import Regression, RegressionStream
from trainer_ext.distributed import DistState, Engine, GradientState, ShardedDataLoader, skip_first_batches
from trainer_ext.distributed.data.batches import allocate, batch_size, describe, join, take
from trainer_ext.distributed.data.loader import (
    DispatchedDataLoader,
    IterableShardLoader,
    TrackedDataLoader,
    shard_dataloader,
)
from trainer_ext.errors import ConfigError

CPU = torch.device("cpu")


class Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Stream(IterableDataset):
    """0, 1, …, n-1 with no length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class SizedStream(Stream):
    def __len__(self) -> int:
        return self.n


def _loader(dataset, b: int, ws: int = 1, rank: int = 0, *, shuffle: bool = False, drop_last: bool = False, **kw):
    plain = DataLoader(dataset, batch_size=b, shuffle=shuffle, drop_last=drop_last)
    return shard_dataloader(plain, num_processes=ws, process_index=rank, gradient_state=GradientState(), seed=3, **kw)


def _lists(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def _steps(per_rank: list[list[list[int]]]) -> list[list[int]]:
    """Step j's global batch: every rank's j-th batch, in rank order."""
    return [sum((p[j] for p in per_rank if j < len(p)), []) for j in range(max(map(len, per_rank)))]


def _real(steps: list[list[int]], batch: int, remainder: int) -> list[int]:
    """The rows of ``steps`` that are real samples: all of full steps, the first ``remainder`` of a short last one."""
    rows = [i for step in steps[:-1] for i in step]
    return rows + steps[-1][: remainder if 0 < remainder < batch else batch]


# -- split_batches on a map-style dataset -------------------------------------------------------------------


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("n", [1, 3, 8, 13, 16, 27])
@pytest.mark.parametrize("shuffle", [False, True])
def test_split_ranks_see_one_process_batches(n: int, ws: int, shuffle: bool) -> None:
    b = 8
    one = _lists(_loader(Indices(n), b, shuffle=shuffle))
    loaders = [_loader(Indices(n), b, ws, r, shuffle=shuffle, split_batches=True) for r in range(ws)]
    per_rank = [_lists(dl) for dl in loaders]
    assert all(len(p) == len(one) == len(dl) for p, dl in zip(per_rank, loaders, strict=True))
    assert all(len(batch) == b // ws for p in per_rank for batch in p)  # even: every part is full
    steps = _steps(per_rank)
    assert [s[: len(o)] for s, o in zip(steps, one, strict=True)] == one  # same samples per step, padding after
    assert all(dl.total_batch_size == b and dl.remainder == n % b for dl in loaders)
    assert _real(steps, b, loaders[0].remainder) == [i for batch in one for i in batch]


def test_split_pads_the_short_last_batch_from_the_head_like_accelerate() -> None:
    per_rank = [_lists(_loader(Indices(13), 4, 2, r, split_batches=True)) for r in range(2)]
    assert per_rank == [[[0, 1], [4, 5], [8, 9], [12, 0]], [[2, 3], [6, 7], [10, 11], [1, 2]]]


def test_split_uneven_gives_partial_slices() -> None:
    loaders = [_loader(Indices(13), 8, 4, r, split_batches=True, even_batches=False) for r in range(4)]
    assert [_lists(dl) for dl in loaders] == [[[0, 1], [8, 9]], [[2, 3], [10, 11]], [[4, 5], [12]], [[6, 7]]]
    assert [len(dl) for dl in loaders] == [2, 2, 2, 2]  # accelerate's count: the original number of batches


def test_split_drop_last() -> None:
    per_rank = [_lists(_loader(Indices(13), 4, 2, r, split_batches=True, drop_last=True)) for r in range(2)]
    assert per_rank == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]]
    assert _loader(Indices(13), 4, 2, 0, split_batches=True, drop_last=True).remainder == -1


@pytest.mark.parametrize(
    "dataset, kwargs",
    [
        (Indices(12), {}),
        (Stream(12), {}),
        (Stream(12), {"device": CPU}),
        (Indices(12), {"device": CPU, "dispatch_batches": True}),
    ],
)
def test_split_needs_a_batch_size_divisible_by_the_processes(dataset, kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=r"batch of 6 samples into 4 .* multiple of 4"):
        _loader(dataset, 6, 4, 0, split_batches=True, **kwargs)
    assert len(_lists(_loader(dataset, 8, 4, 0, split_batches=True, **kwargs))) >= 1


def test_split_skip_and_resume_cut_by_index() -> None:
    loader = _loader(Indices(50), 8, 2, 1, shuffle=True, split_batches=True)
    loader.set_epoch(0)
    full = _lists(loader)
    skipped = skip_first_batches(loader, 3)
    skipped.set_epoch(0)
    assert isinstance(skipped, ShardedDataLoader) and _lists(skipped) == full[3:]
    loader.set_epoch(0)
    seen = []
    for batch in loader:
        seen.append(batch.tolist())
        if len(seen) == 2:
            state = loader.state_dict()
            break
    # split batches: every rank reads a slice of each unsharded batch, so 2 of them are 2 unsharded batches
    assert state == {"epoch": 0, "batches": 2, "global_batches": 2, "processes": 2}
    resumed = _loader(Indices(50), 8, 2, 1, shuffle=True, split_batches=True)
    resumed.load_state_dict(state)
    assert _lists(resumed) == full[2:]


# -- iterable datasets read by every rank (dispatch_batches=False) ----------------------------------------


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("n", [0, 1, 5, 12, 24, 37, 66])
@pytest.mark.parametrize("split", [False, True])
def test_iterable_shards_see_one_process_batches(n: int, ws: int, split: bool) -> None:
    b = 6 if split else 4
    total = b if split else b * ws
    one = _lists(_loader(Stream(n), total))
    loaders = [_loader(Stream(n), b, ws, r, split_batches=split) for r in range(ws)]
    assert all(isinstance(dl, IterableShardLoader) and dl.total_batch_size == total for dl in loaders)
    per_rank = [_lists(dl) for dl in loaders]
    assert len({len(p) for p in per_rank}) == 1  # every rank steps the same number of times
    if not one:
        assert per_rank == [[]] * ws
        return
    steps = _steps(per_rank)
    assert steps[:-1] == one[:-1]
    k = len(one[-1])
    assert loaders[0].remainder == k and steps[-1][:k] == one[-1]
    last = [p[-1] for p in per_rank]
    assert len({len(part) for part in last}) == 1  # equal parts, so that they can be gathered
    assert len(last[0]) == total // ws  # accelerate completes the last group: every rank gets a full batch


def test_iterable_shard_completes_a_short_group_like_accelerate() -> None:
    """3 samples, batch 4 on 2 ranks: the group [0, 1, 2] is repeated up to 8 samples (accelerate 1.15's rows)."""
    assert [_lists(_loader(Stream(3), 4, 2, r)) for r in range(2)] == [[[0, 1, 2, 0]], [[1, 2, 0, 1]]]
    assert [_lists(_loader(Stream(9), 4, 2, r)) for r in range(2)] == [
        [[0, 1, 2, 3], [8, 0, 1, 2]],
        [[4, 5, 6, 7], [3, 4, 5, 6]],
    ]


def test_iterable_shard_pads_from_the_first_rows_and_drops_with_drop_last() -> None:
    assert [_lists(_loader(Stream(10), 2, 2, r)) for r in range(2)] == [
        [[0, 1], [4, 5], [8, 9]],
        [[2, 3], [6, 7], [0, 1]],
    ]
    assert [_lists(_loader(Stream(10), 2, 2, r, drop_last=True)) for r in range(2)] == [
        [[0, 1], [4, 5]],
        [[2, 3], [6, 7]],
    ]


def test_iterable_shard_length_follows_the_stream() -> None:
    loaders = [_loader(SizedStream(37), 4, 2, r) for r in range(2)]
    assert [len(dl) for dl in loaders] == [5, 5] == [len(_lists(dl)) for dl in loaders]
    assert len(_loader(SizedStream(37), 4, 2, 0, drop_last=True)) == 4
    with pytest.raises(TypeError):
        len(_loader(Stream(37), 4, 2, 0))


def test_iterable_shard_remainder_with_worker_processes() -> None:
    """The real count travels with the samples, so a loader fed by a worker process knows it too."""
    plain = DataLoader(Stream(10), batch_size=2, num_workers=1)
    loader = shard_dataloader(plain, num_processes=2, process_index=1, gradient_state=GradientState(), seed=0)
    assert _lists(loader) == [[2, 3], [6, 7], [0, 1]] and loader.remainder == 2


def test_iterable_shard_resume_reads_past_the_seen_batches() -> None:
    loader = _loader(Stream(37), 4, 2, 1)
    full = _lists(loader)
    state = None
    for i, _ in enumerate(loader):
        if i == 1:
            state = loader.state_dict()
            break
    assert state == {"epoch": 1, "batches": 2}  # the first full pass moved it to epoch 1
    resumed = _loader(Stream(37), 4, 2, 1)
    resumed.load_state_dict(state)
    assert _lists(resumed) == full[2:]
    assert _lists(skip_first_batches(_loader(Stream(37), 4, 2, 1), 3)) == full[3:]


# -- one process: an iterable dataset knows the size of its short last batch ---------------------------------


def test_one_process_iterable_remainder_is_the_last_batch_size() -> None:
    gs = GradientState()
    loader = shard_dataloader(
        DataLoader(Stream(66), batch_size=8), num_processes=1, process_index=0, gradient_state=gs, seed=0
    )
    assert isinstance(loader, TrackedDataLoader)
    seen = [(gs.end_of_dataloader, gs.remainder, len(batch)) for batch in loader]
    assert seen[-1] == (True, 2, 2) and len(seen) == 9


# -- dispatching: the default, and rank 0's side --------------------------------------------------------------


@pytest.mark.parametrize(
    "dataset, kwargs, expected",
    [
        (Stream(8), {"device": CPU}, DispatchedDataLoader),  # iterable + placement: dispatched (accelerate)
        (Stream(8), {}, IterableShardLoader),  # no placement: every rank reads
        (Stream(8), {"device": CPU, "dispatch_batches": False}, IterableShardLoader),
        (Indices(8), {"device": CPU}, ShardedDataLoader),  # map-style: sharded by default
        (Indices(8), {"device": CPU, "dispatch_batches": True}, DispatchedDataLoader),
    ],
)
def test_dispatch_default_follows_accelerate(dataset, kwargs: dict, expected: type) -> None:
    assert type(_loader(dataset, 2, 2, 1, **kwargs)) is expected


def test_dispatch_needs_device_placement() -> None:
    with pytest.raises(ConfigError, match="dispatch_batches=True .* device"):
        _loader(Indices(8), 2, 2, 0, dispatch_batches=True)


@pytest.mark.parametrize("n", [0, 3, 8, 13, 16])
@pytest.mark.parametrize("split", [False, True])
def test_dispatch_rank_zero_side(n: int, split: bool) -> None:
    """Without a process group rank 0 still reads, joins and cuts: its part of each global batch."""
    b = 4
    loader = _loader(Stream(n), b, 2, 0, device=CPU, split_batches=split)
    total = b if split else 2 * b
    one = _lists(_loader(Stream(n), total))
    got = _lists(loader)
    assert len(got) == len(one)
    for mine, whole in zip(got[:-1], one[:-1], strict=True):
        assert mine == whole[: total // 2]
    if one:
        k = len(one[-1])
        assert got[-1] == one[-1][: -(-k // 2)]  # accelerate: k // 2 rows each, one more when 2 does not divide k
        assert loader.remainder == k


def test_dispatch_len_and_total_batch_size() -> None:
    loader = _loader(Indices(37), 4, 2, 0, device=CPU, dispatch_batches=True)
    assert (len(loader), loader.total_batch_size, loader.remainder) == (5, 8, 5)
    assert len(_loader(Indices(37), 4, 2, 0, device=CPU, dispatch_batches=True, drop_last=True)) == 4
    split = _loader(Indices(37), 4, 2, 0, device=CPU, dispatch_batches=True, split_batches=True)
    assert (len(split), split.total_batch_size, split.remainder) == (10, 4, 1)


# -- batch row operations -------------------------------------------------------------------------------------

Pair = namedtuple("Pair", "x y")


def test_batches_join_take_describe_allocate() -> None:
    a = {"x": torch.arange(6).view(3, 2), "text": ["a", "b", "c"], "ids": [[1], [2, 2], [3]], "flag": None}
    b = {"x": torch.arange(6, 10).view(2, 2), "text": ["d", "e"], "ids": [[4], [5]], "flag": None}
    joined = join([a, b])
    assert batch_size(joined) == 5 and joined["text"] == ["a", "b", "c", "d", "e"] and joined["flag"] is None
    assert joined["ids"] == [[1], [2, 2], [3], [4], [5]]
    cut = take(joined, [4, 0])
    assert cut["x"].tolist() == [[8, 9], [0, 1]] and cut["text"] == ["e", "a"] and cut["ids"] == [[5], [1]]
    assert take(joined, slice(1, 3))["text"] == ["b", "c"]
    spec = describe(joined)
    made = allocate(spec, CPU)
    assert made["x"].shape == (5, 2) and made["x"].dtype == joined["x"].dtype and made["text"] == joined["text"]
    pair = join([Pair(torch.zeros(2), ["p", "q"]), Pair(torch.ones(1), ["r"])])
    assert isinstance(pair, Pair) and pair.x.tolist() == [0, 0, 1] and pair.y == ["p", "q", "r"]
    encoding = join([BatchEncoding({"input_ids": torch.zeros(2, 3)}), BatchEncoding({"input_ids": torch.ones(1, 3)})])
    assert isinstance(encoding, BatchEncoding) and encoding["input_ids"].shape == (3, 3)
    assert batch_size(["s", "t"]) == 2 and batch_size(torch.tensor(1.0)) is None


def test_dispatch_refuses_batches_that_cannot_be_joined() -> None:
    class Ragged(IterableDataset):
        def __iter__(self):
            yield from (torch.zeros(1, k) for k in (2, 3))

    plain = DataLoader(Ragged(), batch_size=None)
    loader = shard_dataloader(
        plain, num_processes=2, process_index=0, gradient_state=GradientState(), seed=0, device=CPU
    )
    with pytest.raises(ConfigError, match="split_batches=True .* dispatch_batches=False"):
        list(loader)


# -- the engine and the Trainer --------------------------------------------------------------------------------


def test_engine_exposes_and_applies_the_options() -> None:
    engine = Engine(DistState(init=False), split_batches=True, dispatch_batches=False, even_batches=False)
    assert (engine.split_batches, engine.dispatch_batches, engine.even_batches) == (True, False, False)
    default = Engine(DistState(init=False))
    assert (default.split_batches, default.dispatch_batches, default.even_batches) == (False, None, True)
    loader = engine.prepare_dataloader(DataLoader(Indices(10), batch_size=4))
    assert loader.batch_sampler.split_batches and not loader.batch_sampler.even_batches
    assert loader.total_batch_size == 4


@pytest.mark.timeout(60)
def test_trainer_evaluate_on_an_iterable_dataset_is_the_per_sample_mean(tmp_path: Path) -> None:
    """66 samples, batch 8: the short last batch of 2 counts twice, not eight times (transformers repeats each
    batch loss ``eval_batch_size`` times and cuts the repeats with the loader's ``remainder``)."""
    import trainer_ext

    torch.manual_seed(0)
    model = Regression()
    args = trainer_ext.TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=8, report_to=[], use_cpu=True
    )
    trainer = trainer_ext.Trainer(model=model, args=args, eval_dataset=RegressionStream(66))
    metrics = trainer.evaluate()
    with torch.no_grad():
        losses = [float(model(s["x"][None], labels=s["labels"][None])["loss"]) for s in RegressionStream(66)]
    expected = sum(losses) / len(losses)
    batches = [losses[i : i + 8] for i in range(0, 66, 8)]  # the old answer: the last batch weighted as 8 samples
    wrong = sum(sum(b) / len(b) for b in batches) / len(batches)
    assert abs(expected - wrong) > 1e-3, "the data must tell the two apart for the test to mean anything"
    assert math.isclose(metrics["eval_loss"], expected, rel_tol=1e-6)
    predictions = trainer.predict(RegressionStream(66)).predictions
    assert predictions.shape == (66,)


def test_a_seedable_loader_cut_short_by_drop_last_still_moves_to_the_next_epoch() -> None:
    """5 batches on 2 ranks with drop_last: each pass stops after 2 rounds, before the sampler runs out; the next
    pass must still shuffle anew (accelerate sets the epoch at every pass)."""
    loader = _loader(Indices(10), 2, 2, 0, shuffle=True, drop_last=True)
    passes = [_lists(loader) for _ in range(3)]
    assert all(len(p) == 2 for p in passes)
    assert passes[0] != passes[1] != passes[2]
    assert loader.state_dict()["epoch"] == 3
