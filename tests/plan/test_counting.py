"""Counted collectives on 2 real gloo ranks: what :class:`CollectiveCounter` sees of each way a collective is issued,
and ``measure_layout``'s count of a real ``train`` step against :func:`step_traffic` per collective and mesh
dimension, within 15 %, for DDP, FSDP2 and ZeRO-2 (with accumulation), tensor, pipeline and context parallelism.

One measuring run per layout, shared by the tests of the module. Collectives below 1 % of a step's counted bytes
(gradient-norm all-reduces, the pipeline's loss broadcast, DDP's buffer broadcasts) are the model's documented
omissions and not compared.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.paths import CONFIGS
from tests.helpers.ranks import run_ranks
from trainer_ext.estimate.job import job_from_argv
from trainer_ext.plan.comms import by_collective, step_traffic
from trainer_ext.plan.worker import measure_layout

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOLERANCE = 0.15
SMALL = 0.01  # share of a step's counted bytes below which a collective is not compared
BATCH = ["--task", "causal-lm", "--per_device_train_batch_size", "2", "--max_seq_length", "64"]
TINY = ["--model_config", "tiny-llama", *BATCH]
UNTIED = ["--model_config", "tiny-llama-untied", *BATCH]  # pipeline stages need an untied head
ACCUMULATE = ["--gradient_accumulation_steps", "2"]  # per-step and per-micro-batch collectives differ then
LAYOUTS = {
    "ddp": [*TINY, *ACCUMULATE],
    "fsdp2": [*TINY, "--fsdp", "full_shard", *ACCUMULATE],
    "zero2": [*TINY, "--deepspeed", str(CONFIGS / "deepspeed" / "zero2.json"), *ACCUMULATE],
    "tp2": [*TINY, "--tp_size", "2"],
    "pp2": [*UNTIED, "--pp_size", "2"],
    "cp2": [*TINY, "--cp_size", "2"],
}


def test_counter_sees_each_way_a_collective_is_issued(tmp_path) -> None:
    run_ranks("tests.plan.counter_job", 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, seen in enumerate(ranks):
        # torch.distributed's calls: the tensor (10 floats), the gathered output (8), the scattered input (8), the
        # broadcast tensor (5), the all-to-all input (8)
        assert seen["c10d"] == {
            "all_reduce": 40,
            "all_gather": 32,
            "reduce_scatter": 32,
            "broadcast": 20,
            "all_to_all": 32,
        }
        # 6 floats sent by rank 0, received by rank 1
        assert seen["p2p"] == ({"send_recv": 24} if rank == 0 else {"recv": 24})
        # DTensor's functional collectives, each counted once (not again as the c10d op it runs)
        assert seen["functional"] == {"all_reduce": 24, "all_gather": 32, "reduce_scatter": 32}
        # DDP's C++ reducer all-reduces the 340 gradients in backward
        assert seen["ddp"] == {"all_reduce": 340 * 4}
        # FSDP2: both layers gathered in forward and again in backward, the gradients reduce-scattered
        assert seen["fsdp"] == {"all_gather": 2 * 340 * 4, "reduce_scatter": 340 * 4}
        # colwise + rowwise: the rowwise output summed in forward, the colwise input's gradient in backward (4 x 16)
        assert seen["tp"] == {"all_reduce": 2 * 4 * 16 * 4}
        # a matmul of two row-sharded DTensors: DTensor gathers one 8 x 8 operand inside its dispatch
        assert seen["implicit"] == {"all_gather": 8 * 8 * 4}


@pytest.fixture(scope="module")
def results() -> dict:
    return {}


def _result(results: dict, name: str) -> tuple[dict, dict]:
    """(measured, predicted) for layout ``name``: one measuring run per module."""
    if name not in results:
        argv = LAYOUTS[name]
        job = job_from_argv(argv, 2)
        measured = measure_layout(argv, 2, timeout=500, setup=job.setup)
        results[name] = measured, step_traffic(job.shape, job.setup)
    return results[name]


def _compare(counted: dict, predicted: dict, what: str) -> list:
    """Keys compared; AssertionError where a collective's counted and predicted bytes differ by more than 15 %."""
    total = sum(counted.values())
    assert total > 0, f"nothing counted ({what})"
    compared = []
    for key in sorted(set(counted) | set(predicted)):
        got, want = counted.get(key, 0), predicted.get(key, 0)
        if max(got, want) < SMALL * total:
            continue
        assert abs(got - want) <= TOLERANCE * max(got, 1), f"{what} {key}: counted {got}, predicted {want}"
        compared.append(key)
    return compared


def _check(measured: dict, predicted: list) -> None:
    kinds = _compare(measured["collectives"], by_collective(predicted), "collective")
    assert kinds, "no collective compared"
    dims = {(kind, dim): nbytes for kind, per in measured["dimensions"].items() for dim, nbytes in per.items()}
    wanted: dict = {}
    for item in predicted:
        wanted[item.collective, item.dimension] = wanted.get((item.collective, item.dimension), 0) + item.bytes
    _compare(dims, wanted, "collective and dimension")
    for key in ("weights", "gradients", "optimizer", "activations", "total"):
        assert measured[key] > 0, key  # MeasureCallback's memory keys ride along
    assert len(measured["ranks"]) == 2


def test_ddp_counted_within_15_percent(results) -> None:
    measured, predicted = _result(results, "ddp")
    _check(measured, predicted)
    assert set(measured["dimensions"]["all_reduce"]) == {"dp"}


def test_fsdp2_counted_within_15_percent(results) -> None:
    measured, predicted = _result(results, "fsdp2")
    _check(measured, predicted)
    # two micro-batches gather twice, reduce-scatter once: the gathers are about 2 x (1 + layers' share) the reduction
    counted = measured["collectives"]
    assert counted["all_gather"] > 3 * counted["reduce_scatter"]


@pytest.mark.deepspeed
def test_zero2_counted_within_15_percent(results) -> None:
    measured, predicted = _result(results, "zero2")
    _check(measured, predicted)
    counted = measured["collectives"]  # ZeRO-2 reduces every micro-batch: twice the parameters it gathers once
    assert counted["all_reduce"] == pytest.approx(2 * counted["all_gather"], rel=0.01)


def test_tensor_parallel_counted_within_15_percent(results) -> None:
    measured, predicted = _result(results, "tp2")
    _check(measured, predicted)
    assert set(measured["dimensions"]["all_reduce"]) == {"tp"}


def test_pipeline_counted_within_15_percent(results) -> None:
    measured, predicted = _result(results, "pp2")
    _check(measured, predicted)
    assert measured["collectives"]["send_recv"] > 0
    assert set(measured["dimensions"]["send_recv"]) == {"pp"}


def test_context_parallel_counted_within_15_percent(results) -> None:
    measured, predicted = _result(results, "cp2")
    _check(measured, predicted)
    assert set(measured["dimensions"]["all_gather"]) == {"cp"}
