"""A hand-written Accelerator loop on an N-D mesh of real gloo ranks against one process: a tiny Llama in float64,
ten optimizer steps of a global batch of 8 (``accumulate`` over 2 micro-batches, ``clip_grad_norm_`` at 0.5, AdamW)
under tensor parallelism over 2 ranks and FSDP2 × TP (shard 2 × tp 2); the mesh and each rank's coordinates;
``save_state`` after step 5 and ``load_state`` replaying steps 6-10 bitwise. The launches are shared with the
Trainer's tests (:mod:`tests.distributed.nd_runs`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.nd_runs import launched, run_diff, seen

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

NOT_SHARDED = "Shard-based data parallelism is not configured. Set `parallelism_config` first."
NOT_REPLICATED = "Data parallelism is not configured. Set `parallelism_config` first."


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "nd"


@pytest.mark.parametrize("mesh", ["tp2", "fsdp_tp"])
def test_loop_matches_one_process(root: Path, mesh: str) -> None:
    got, one = seen(launched(root, mesh), "loop"), seen(launched(root, "one"), "loop")
    assert len(got["norms"]) == 10 and len(got["losses"]) == 20
    diff = run_diff(got, one)
    assert max(diff.values()) <= 1e-5, (mesh, diff)


def test_the_mesh_and_each_ranks_coordinates(root: Path) -> None:
    tp2 = seen(launched(root, "tp2"), "loop")
    assert tp2["mesh"] == (["tp"], [2])
    assert [r["tensor_parallel_rank"] for r in tp2["ranks"]] == [0, 1]
    assert {r["data_parallel_shard_rank"] for r in tp2["ranks"]} == {NOT_SHARDED}
    fsdp_tp = seen(launched(root, "fsdp_tp"), "loop")
    assert fsdp_tp["mesh"] == (["dp_shard", "tp"], [2, 2])
    assert [r["tensor_parallel_rank"] for r in fsdp_tp["ranks"]] == [0, 1, 0, 1]
    assert [r["data_parallel_shard_rank"] for r in fsdp_tp["ranks"]] == [0, 0, 1, 1]
    assert {r["data_parallel_rank"] for r in fsdp_tp["ranks"]} == {NOT_REPLICATED}
    assert seen(launched(root, "one"), "loop")["mesh"] is None


@pytest.mark.parametrize("mesh", ["tp2", "fsdp_tp"])
def test_load_state_replays_the_steps_bitwise(root: Path, mesh: str) -> None:
    """``load_state`` of the state saved after step 5 puts model and optimizer back: steps 6-10 again give the
    same losses, norms and weights, to the bit."""
    got = seen(launched(root, mesh), "loop")
    losses, norms = got["resumed"]
    assert losses == got["losses"][10:] and norms == got["norms"][5:]
    unequal = [k for k, w in got["resumed_weights"].items() if not torch.equal(w, got["weights"][k])]
    assert got["resumed_weights"].keys() == got["weights"].keys() and not unequal, unequal
