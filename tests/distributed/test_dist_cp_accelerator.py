"""Hand-written ``trainer_ext.Accelerator`` loops under context parallelism on real gloo ranks against one process:
a tiny float64 Llama with GQA on SDPA, ragged right-padded rows, 10 AdamW steps of 2 accumulated micro-batches with
``clip_grad_norm_``, on cp 2 (2 ranks) and cp 2 × dp_shard 2 (4 ranks); ``save_state`` after step 5 and a fresh run's
``load_state`` replaying steps 6-10 bitwise; the context-parallel attention's logits and gradients on a right-padded,
a left-padded and a packed batch with cp 2 and cp 4, and under activation checkpointing (recomputed inside the
region; refused after it).
The launches (:mod:`tests.distributed.cp_loop_job`) run once per session and are shared by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.nd_runs import max_diff, run_diff, seen
from tests.helpers.ranks import launch_once

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

JOB = "tests.distributed.cp_loop_job"
# name -> (processes, "cp,dp_shard", tasks)
LAUNCHES = {
    "one": (1, "1,1", ("loop", "manual", "plain")),
    "cp2": (2, "2,1", ("loop", "manual", "plain", "parity", "checkpointing", "reentrant")),
    "cp2_dp2": (4, "2,2", ("loop", "manual", "plain")),
    "cp4": (4, "4,1", ("parity",)),
}
RECOMPUTED_OUTSIDE = (
    "ConfigError: activation checkpointing recomputed LlamaAttention after the context-parallel region exited: call "
    "backward inside maybe_context_parallel (as the Trainer does)"
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "cp_loops"


def launched(root: Path, name: str) -> Path:
    """The output folder of launch ``name``, run on first use (a failed launch fails every test that reads it)."""
    nproc, sizes, tasks = LAUNCHES[name]
    return launch_once(root / name, name, JOB, nproc, sizes, *tasks)


@pytest.mark.parametrize("mesh", ["cp2", "cp2_dp2"])
@pytest.mark.parametrize("pattern", ["loop", "manual"])
def test_loop_matches_one_process(root: Path, mesh: str, pattern: str) -> None:
    """The loss normalised by the global token count (``context_parallel_batch``, or the same written out by hand):
    losses, gradient norms and weights of one process (the loss is computed in float32 by transformers)."""
    got, one = seen(launched(root, mesh), pattern), seen(launched(root, "one"), pattern)
    assert len(got["norms"]) == 10 and len(got["losses"]) == 20
    diff = run_diff(got, one)
    assert diff["weights"] <= 1e-12 and diff["norm"] <= 1e-12 and diff["loss"] <= 1e-5, (mesh, pattern, diff)


def test_the_helper_and_the_written_out_pattern_agree(root: Path) -> None:
    for mesh in ("one", "cp2", "cp2_dp2"):
        out = launched(root, mesh)
        assert max_diff(seen(out, "loop")["weights"], seen(out, "manual")["weights"]) <= 1e-15, mesh


def test_accelerates_per_rank_mean_is_not_the_one_process_loss(root: Path) -> None:
    """accelerate's pattern (``loss = outputs.loss``: each rank's mean over its own tokens, averaged over the ranks)
    weighs the tokens of ragged rows unequally: it is the same as the exact loop on one process only."""
    one = seen(launched(root, "one"), "plain")
    assert run_diff(one, seen(launched(root, "one"), "loop"))["weights"] <= 1e-15
    for mesh in ("cp2", "cp2_dp2"):
        diff = run_diff(seen(launched(root, mesh), "plain"), one)
        assert diff["weights"] > 1e-4, (mesh, diff)  # measured 5.6e-3 (cp2) and 8.8e-3 (cp2 × dp2)


def test_the_mesh_and_each_ranks_context_parallel_rank(root: Path) -> None:
    cp2 = seen(launched(root, "cp2"), "loop")
    assert cp2["mesh"] == (["cp"], [2])
    assert [r["context_parallel_rank"] for r in cp2["ranks"]] == [0, 1]
    grid = seen(launched(root, "cp2_dp2"), "loop")
    assert grid["mesh"] == (["dp_shard", "cp"], [2, 2])
    assert [r["context_parallel_rank"] for r in grid["ranks"]] == [0, 1, 0, 1]
    assert [r["data_parallel_shard_rank"] for r in grid["ranks"]] == [0, 0, 1, 1]
    assert seen(launched(root, "one"), "loop")["mesh"] is None


@pytest.mark.parametrize("mesh", ["one", "cp2", "cp2_dp2"])
def test_a_fresh_runs_load_state_replays_the_steps_bitwise(root: Path, mesh: str) -> None:
    got = seen(launched(root, mesh), "loop")
    losses, norms = got["resumed"]
    assert losses == got["losses"][10:] and norms == got["norms"][5:]
    unequal = [k for k, w in got["resumed_weights"].items() if not torch.equal(w, got["weights"][k])]
    assert got["resumed_weights"].keys() == got["weights"].keys() and not unequal, unequal


@pytest.mark.parametrize(("mesh", "task"), [("cp2", "parity"), ("cp4", "parity"), ("cp2", "checkpointing")])
@pytest.mark.parametrize("batch", ["padded", "left", "packed"])
def test_attention_logits_and_gradients_equal_one_process(root: Path, mesh: str, task: str, batch: str) -> None:
    """GQA (4 heads, 2 KV heads); rows of 16, 11 and 5 tokens padded on the right or the left (a left pad attends to
    nothing: SDPA gives it 0, and its logits predict the row's first label), or two rows packing 2 and 3 documents."""
    got = seen(launched(root, mesh), task)[batch]
    assert got["logits"] <= 1e-12 and got["grads"] <= 1e-12 and got["loss"] <= 1e-5, got
    assert got["grad_scale"] > 0.1  # the gradients compared are not all zero


@pytest.mark.parametrize("task", ["checkpointing", "reentrant"])
@pytest.mark.parametrize("batch", ["padded_outside", "packed_outside"])
def test_recomputation_after_the_region_is_refused(root: Path, task: str, batch: str) -> None:
    """Activation checkpointing recomputes attention in backward: outside the region it would attend over the local
    slice alone (with reentrant checkpointing, silently wrong gradients on the packed batch: 0.32 off)."""
    assert seen(launched(root, "cp2"), task)[batch] == {"error": RECOMPUTED_OUTSIDE}
    assert max(seen(launched(root, "cp2"), task)[case]["grads"] for case in ("padded", "packed")) <= 1e-12
