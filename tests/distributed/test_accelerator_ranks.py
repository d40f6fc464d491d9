"""accelerate's process API across two real gloo ranks (see tests/helpers/accelerator_ranks.py)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("accelerator_ranks")
    run_ranks("tests.helpers.accelerator_ranks", 2, str(out), timeout=300)
    return json.loads((out / "results.json").read_text())


def test_split_between_processes(ranks: list[dict]) -> None:
    assert [r["split"] for r in ranks] == [["A", "B", "C"], ["D", "E"]]
    assert [r["split_padded"] for r in ranks] == [["A", "B", "C"], ["D", "E", "E"]]
    assert [r["split_dict"] for r in ranks] == [{"x": [1, 2], "y": [4, 5]}, {"x": [3], "y": [6]}]


def test_decorators_run_on_their_process_only(ranks: list[dict]) -> None:
    assert [r["on_main"] for r in ranks] == [0, None]
    assert [r["on_last"] for r in ranks] == [None, 1]
    assert [r["on_process_1"] for r in ranks] == [None, 1]
    assert [r["on_local_process_0"] for r in ranks] == [0, None]


def test_a_trigger_set_on_one_rank_is_seen_by_all_once(ranks: list[dict]) -> None:
    assert [r["trigger"] for r in ranks] == [[True, False], [True, False]]


def test_the_scheduler_follows_accelerate_unless_told_to_count_optimizer_steps(ranks: list[dict]) -> None:
    """8 unsharded batches make a 1-epoch schedule of 8 steps; 2 ranks take 4 optimizer steps."""
    for r in ranks:
        assert r["schedule_accelerate"] == {"optimizer_steps": 4, "lr": 0.0}  # 2 scheduler steps per step: on time
        assert r["schedule_once"] == {"optimizer_steps": 4, "lr": 0.5}  # once per step: half-way, as sized


def test_join_uneven_inputs_trains_ranks_with_different_batch_counts(ranks: list[dict]) -> None:
    uneven = [r["uneven"] for r in ranks]
    assert [u["steps"] for u in uneven] == [2, 1]
    assert uneven[0]["weight"] == uneven[1]["weight"]  # Join keeps the replicas equal
    assert all(u["even_after"] for u in uneven)  # the override ends with the block


def test_ddp_kwargs_split_batches_and_iterable_data(ranks: list[dict]) -> None:
    assert all(r["ddp_find_unused"] for r in ranks)
    assert [r["split_batches"] for r in ranks] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert [r["iterable"] for r in ranks] == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
