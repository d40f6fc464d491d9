"""Hand-written ``trainer_ext.Accelerator`` loops under pipeline parallelism on real gloo ranks against one process:
a tiny float64 Llama (4 layers, untied) on SDPA, ragged right-padded rows, 10 AdamW steps of 2 accumulated
micro-batches with ``clip_grad_norm_``, through ``pipeline_step`` on pp 2 with 1F1B and interleaved 1F1B (2 ranks)
and on pp 2 × dp_shard 2 (4 ranks); the one-process run trains the plain model with ``accelerator.backward``.
``save_state`` after step 5 and a fresh run's ``load_state`` replay steps 6-10 bitwise; ``pipeline_eval_step``'s
logits through ``gather_for_metrics`` equal one process's.
The launches (:mod:`tests.distributed.pp_loop_job`) run once per session and are shared by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.nd_runs import run_diff, seen
from tests.helpers.ranks import launch_once
from tests.helpers.tiny import VOCAB

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

JOB = "tests.distributed.pp_loop_job"
# name -> (processes, "pp,dp_shard", schedule, tasks)
LAUNCHES = {
    "one": (1, "1,1", "1f1b", ("counted", "mean", "refusal")),
    "pp2": (2, "2,1", "1f1b", ("counted", "mean")),
    "pp2_interleaved": (2, "2,1", "interleaved_1f1b", ("counted", "mean")),
    "pp2_dp2": (4, "2,2", "1f1b", ("counted",)),  # each rank's mean differs from the global one: counted only
}
PIPELINES = ("pp2", "pp2_interleaved", "pp2_dp2")
NOT_SPLIT = (
    "{} runs a model split into pipeline stages, and LlamaForCausalLM is not one: build the Accelerator with "
    "ParallelismConfig(pp_size=...) and pass the model through accelerator.prepare"
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "pp_loops"


def launched(root: Path, name: str) -> Path:
    """The output folder of launch ``name``, run on first use (a failed launch fails every test that reads it)."""
    nproc, sizes, schedule, tasks = LAUNCHES[name]
    return launch_once(root / name, name, JOB, nproc, sizes, schedule, *tasks)


@pytest.mark.parametrize(
    ("mesh", "pattern"), [(m, "counted") for m in PIPELINES] + [("pp2", "mean"), ("pp2_interleaved", "mean")]
)
def test_loop_matches_one_process(root: Path, mesh: str, pattern: str) -> None:
    """``counted``: the loss over the window's token count on every data-parallel rank; ``mean``: each batch's mean
    over the accumulation steps. Losses (computed in float32 by transformers), gradient norms and weights."""
    got, one = seen(launched(root, mesh), pattern), seen(launched(root, "one"), pattern)
    assert len(got["norms"]) == 10 and len(got["losses"]) == 20
    diff = run_diff(got, one)
    assert diff["weights"] <= 1e-10 and diff["norm"] <= 1e-10 and diff["loss"] <= 1e-5, (mesh, pattern, diff)


def test_each_ranks_pipeline_parallel_rank(root: Path) -> None:
    """The pp coordinate (the stages of one batch are neighbouring ranks); accelerate's error without pp."""
    assert seen(launched(root, "pp2"), "counted")["ranks"] == [0, 1]
    assert seen(launched(root, "pp2_dp2"), "counted")["ranks"] == [0, 1, 0, 1]
    assert seen(launched(root, "one"), "counted")["ranks"] == [
        "NotImplementedError: Pipeline parallelism is currently not supported in Accelerate."
    ]


@pytest.mark.parametrize("mesh", ["one", *PIPELINES])
def test_a_fresh_runs_load_state_replays_the_steps_bitwise(root: Path, mesh: str) -> None:
    got = seen(launched(root, mesh), "counted")
    losses, norms = got["resumed"]
    assert losses == got["losses"][10:] and norms == got["norms"][5:]
    unequal = [k for k, w in got["resumed_weights"].items() if not torch.equal(w, got["weights"][k])]
    assert got["resumed_weights"].keys() == got["weights"].keys() and not unequal, unequal


@pytest.mark.parametrize("mesh", PIPELINES)
def test_gathered_eval_logits_equal_one_process(root: Path, mesh: str) -> None:
    """10 rows, 2 per data-parallel rank and batch: under dp_shard 2 the last round is completed by repeats, which
    ``gather_for_metrics`` drops; interleaved 1F1B runs 4 microbatches, so each batch gets 2 ignored rows."""
    got, one = seen(launched(root, mesh), "counted")["eval"], seen(launched(root, "one"), "counted")["eval"]
    assert got["logits"].shape == one["logits"].shape == (10, 16, VOCAB)
    assert (got["logits"] - one["logits"]).abs().max().item() <= 1e-9
    if mesh != "pp2_dp2":  # one batch per step on both: the same losses (the token mean of each batch)
        assert max(abs(a - b) for a, b in zip(got["losses"], one["losses"], strict=True)) <= 1e-5


def test_a_model_that_is_not_split_is_refused(root: Path) -> None:
    got = seen(launched(root, "one"), "refusal")
    assert got == {"step": NOT_SPLIT.format("pipeline_step"), "eval": NOT_SPLIT.format("pipeline_eval_step")}
