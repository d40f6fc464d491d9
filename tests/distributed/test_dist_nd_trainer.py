"""The Trainer on an N-D mesh of real gloo ranks against one process at the same global batch of 16 sequences: a
tiny Llama (2 layers, hidden 64, 4 heads, 2 KV heads) under tensor parallelism over 2 ranks, FSDP2 × TP (shard 2 ×
tp 2) and HSDP (replicate 2 × shard 2), and a tiny Qwen2 (biased q/k/v) under TP 2.

Ten optimizer steps (accumulation 8, 4 or 2 on 1 or 2, 2 × 2 or 4 data-parallel ranks; clipping at 0.5, the
Trainer's default fused AdamW), the model in float64 so that the comparison sees the parallelism and not AdamW
turning last-bit gradient noise into ~1e-5 weight moves (float32 does that whatever the layout); transformers
computes the loss in float32 either way, so losses differ by float32 summation order (~5e-7).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.nd_runs import assert_resumed_bitwise, launched, run_diff, seen

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

PARITY, ACROSS = 1e-5, 1e-6


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "nd"


@pytest.mark.parametrize("mesh", ["tp2", "fsdp_tp", "hsdp"])
def test_training_matches_one_process(root: Path, mesh: str) -> None:
    got, one = seen(launched(root, mesh), "train"), seen(launched(root, "one"), "train")
    assert got["steps"] == one["steps"] == 10 and len(got["norms"]) == 10
    diff = run_diff(got, one)
    assert max(diff.values()) <= PARITY, (mesh, diff)
    assert got["losses"][-1] < got["losses"][0] - 0.05  # it trained


def test_qwen2_under_tensor_parallelism_matches_one_process(root: Path) -> None:
    got, one = seen(launched(root, "tp2"), "qwen2"), seen(launched(root, "one"), "qwen2")
    assert got["steps"] == 10
    diff = run_diff(got, one)
    assert max(diff.values()) <= PARITY, diff


def test_resume_on_the_same_mesh_is_bitwise(root: Path) -> None:
    """A fresh TP 2 Trainer resumed from checkpoint-5 of the uninterrupted TP 2 run ends where that run ended."""
    assert_resumed_bitwise(launched(root, "tp2"))


@pytest.mark.parametrize("mesh", ["fsdp_tp", "one"])
def test_resume_on_another_mesh(root: Path, mesh: str) -> None:
    """TP 2's checkpoint-5 resumed under FSDP2 × TP 2×2 and on one process: steps 6-10 as TP 2 ran them."""
    uninterrupted = seen(launched(root, "tp2"), "train")
    resumed = seen(launched(root, mesh), "from")
    assert resumed["steps"] == 10
    assert resumed["losses"][:5] == uninterrupted["losses"][:5]  # the checkpoint's history
    diff = run_diff(resumed, uninterrupted)
    assert max(diff.values()) <= ACROSS, (mesh, diff)


@pytest.mark.parametrize("mesh", ["tp2", "fsdp_tp"])
def test_the_export_reloads_on_one_process(root: Path, mesh: str) -> None:
    """save_model writes one consolidated model.safetensors; from_pretrained on rank 0 alone gives the logits the
    sharded model in memory gives."""
    got = seen(launched(root, mesh), "train")
    assert "model.safetensors" in got["export_files"]
    assert not [f for f in got["export_files"] if f.startswith("model-") or f.endswith(".index.json")]
    assert got["export_diff"] <= PARITY


@pytest.mark.parametrize("mesh", ["tp2", "fsdp_tp"])
def test_evaluation_counts_each_sample_once(root: Path, mesh: str) -> None:
    """13 ragged rows in batches of 3 (TP 2: one data-parallel rank; 2×2: two, so the last round is padded and cut):
    ``eval_loss`` as one process has it (the mean of batch means too where the batches are one process's),
    ``predict`` and ``gather_for_metrics`` return every row once, in order."""
    got, one = seen(launched(root, mesh), "eval"), seen(launched(root, "one"), "eval")
    rows = got["rows"]
    assert len(rows) == 13
    assert abs(got["eval_loss_True"] - one["eval_loss_True"]) <= PARITY
    if mesh == "tp2":
        assert abs(got["eval_loss_False"] - one["eval_loss_False"]) <= PARITY
    assert got["lengths"] == [len(r) for r in rows]
    labels = [[t for t in row if t != -100] for row in got["label_ids"]]
    assert labels == [list(r) for r in rows]
    assert got["predictions"].shape[0] == 13
    mask = torch.tensor(got["label_ids"]) != -100
    assert torch.equal(mask, torch.tensor(one["label_ids"]) != -100)
    assert (got["predictions"][mask] - one["predictions"][mask]).abs().max().item() <= PARITY
