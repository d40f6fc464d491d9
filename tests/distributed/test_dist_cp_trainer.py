"""The Trainer under context parallelism on real gloo ranks against one process: a tiny float64 Llama on SDPA
(2 layers, hidden 64, 4 heads, 2 KV heads) with cp 2, cp 2 × dp_shard 2 and cp 2 × tp 2, at the same global batch
of 8 ragged, right-padded rows per optimizer step (accumulation 4 or 2 on 1 or 2 data-parallel ranks; the cp ranks
of a group share a batch and split each row into 4 chunks, head-tail).

Ten optimizer steps with clipping at 0.5 and the Trainer's fused AdamW. The model is float64, so gradient norms,
weights and logits agree to ~1e-15 and are held to :data:`EXACT`; transformers computes the loss in float32, so
logged and evaluation losses differ by float32 summation order (one ulp, ~5e-7) and are held to :data:`LOSS`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DataCollatorWithFlattening

from tests.distributed.cp_job import PACKED_PER_DEVICE, unpacked
from tests.distributed.cp_runs import launched, source
from tests.distributed.nd_runs import assert_resumed_bitwise, run_diff, seen
from tests.helpers.tiny import ragged_lm_dataset
from trainer_ext.distributed.mesh.cp_attention import NAME

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

EXACT, LOSS = 1e-9, 1e-6
MESHES = ["cp2", "cp_dp", "cp_tp"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "cp"


def assert_close(diff: dict[str, float], what: object) -> None:
    assert diff["loss"] <= LOSS and diff["norm"] <= EXACT and diff["weights"] <= EXACT, (what, diff)


@pytest.mark.parametrize("mesh", MESHES)
def test_training_matches_one_process(root: Path, mesh: str) -> None:
    got, one = seen(launched(root, mesh), "train"), seen(launched(root, "one"), "train")
    assert got["steps"] == one["steps"] == 10 and len(got["norms"]) == 10
    assert min(got["norms"]) > 0.5  # every step clips
    assert_close(run_diff(got, one), mesh)
    assert got["losses"][-1] < got["losses"][0] - 0.2  # it trained


@pytest.mark.parametrize("mesh", ["cp2", "cp_dp"])
def test_resume_on_the_same_mesh_is_bitwise(root: Path, mesh: str) -> None:
    """A fresh Trainer resumed from checkpoint-5 of the uninterrupted run on the same mesh ends where it ended."""
    assert_resumed_bitwise(launched(root, mesh))


@pytest.mark.parametrize("mesh", ["one", "cp_dp"])
def test_resume_on_another_mesh(root: Path, mesh: str) -> None:
    """cp 2's checkpoint-5 resumed on one process, and one process's on cp 2 × dp_shard 2: steps 6-10 as the run
    that wrote the checkpoint took them."""
    uninterrupted = seen(launched(root, source(mesh)), "train")
    resumed = seen(launched(root, mesh), "from")
    assert resumed["steps"] == 10
    assert resumed["losses"][:5] == uninterrupted["losses"][:5]  # the checkpoint's history
    assert_close(run_diff(resumed, uninterrupted), mesh)


@pytest.mark.parametrize("mesh", MESHES)
def test_the_export_reloads_on_one_process(root: Path, mesh: str) -> None:
    """save_model writes one consolidated model.safetensors; from_pretrained on rank 0 alone (SDPA, float64: the
    export names neither our attention nor another dtype) gives the logits the sharded model in memory gives."""
    got = seen(launched(root, mesh), "train")
    assert "model.safetensors" in got["export_files"]
    assert not [f for f in got["export_files"] if f.startswith("model-") or f.endswith(".index.json")]
    assert got["export_attention"] == "sdpa" != NAME and got["export_dtype"] == "torch.float64"
    assert got["export_diff"] <= EXACT


@pytest.mark.parametrize("mesh", MESHES)
def test_evaluation_counts_each_sample_once(root: Path, mesh: str) -> None:
    """13 ragged rows in batches of 3, each split over the cp ranks (cp 2 × dp_shard 2: two data-parallel ranks, so
    the last round is padded and cut): the exact ``eval_loss`` as one process has it, and the mean of batch means
    where the batches are one process's; ``predict`` (logits joined over cp) and ``gather_for_metrics`` of a
    per-row tensor return every row once, in order."""
    got, one = seen(launched(root, mesh), "eval"), seen(launched(root, "one"), "eval")
    rows = got["rows"]
    assert len(rows) == 13
    assert abs(got["eval_loss_True"] - one["eval_loss_True"]) <= LOSS
    if mesh != "cp_dp":
        assert abs(got["eval_loss_False"] - one["eval_loss_False"]) <= LOSS
    assert got["lengths"] == [len(r) for r in rows]
    labels = [[t for t in row if t != -100] for row in got["label_ids"]]
    assert labels == [list(r) for r in rows]
    assert got["predictions"].shape == one["predictions"].shape
    mask = torch.tensor(got["label_ids"]) != -100
    assert torch.equal(mask, torch.tensor(one["label_ids"]) != -100)
    assert (got["predictions"][mask] - one["predictions"][mask]).abs().max().item() <= EXACT


def test_unpacked_rows_are_labelled_as_the_packed_row() -> None:
    """The flattening collator's row and the unpacked rows hold the same tokens and the same labels, token for
    token (-100 on each document's first), and the packed row marks its documents by position_ids alone."""
    docs = ragged_lm_dataset(PACKED_PER_DEVICE, seed=3).to_list()
    packed, rows = DataCollatorWithFlattening()(docs, return_tensors="pt"), unpacked(docs)
    assert "attention_mask" not in packed and packed["input_ids"].shape[0] == 1
    real = rows["attention_mask"].bool()
    assert torch.equal(packed["input_ids"][0], rows["input_ids"][real])
    assert torch.equal(packed["labels"][0], rows["labels"][real])
    assert int((packed["labels"] == -100).sum()) == len(docs)
    starts = torch.cat([torch.arange(len(d["input_ids"])) for d in docs])
    assert torch.equal(packed["position_ids"][0], starts)


@pytest.mark.parametrize("mesh", ["one", "cp2"])
def test_packed_documents_train_as_unpacked_rows(root: Path, mesh: str) -> None:
    """Three SGD steps (accumulation 2, clipping) on 18 documents packed 3 to a row train as the same documents one
    to a right-padded row, on that mesh and on one process: losses, gradient norms and weights."""
    out = launched(root, mesh)
    packed = seen(out, "packed")
    assert packed["steps"] == 3
    assert_close(run_diff(packed, seen(out, "unpacked")), mesh)
    assert_close(run_diff(packed, seen(launched(root, "one"), "unpacked")), mesh)


def test_packed_documents_stay_apart_when_the_arguments_ask_for_the_cache(root: Path) -> None:
    """``TrainingArguments(use_cache=True)`` sets the model's config to build a key/value cache in training, and
    transformers builds no block mask for packed documents with one: our Trainer turns the cache off for packed
    batches, so they still train as the unpacked rows (with the default ``use_cache=False`` no cache is built)."""
    out = launched(root, "one")
    assert_close(run_diff(seen(out, "packed_args_cache"), seen(out, "unpacked")), "use_cache=True")


def test_packed_documents_attend_across_their_boundaries_with_the_cache(root: Path) -> None:
    """The checks above can fail: with ``use_cache=True`` in each batch (which the Trainer leaves as it is) the
    packed documents see each other on one process, and the run leaves the unpacked one."""
    out = launched(root, "one")
    diff = run_diff(seen(out, "packed_cache"), seen(out, "unpacked"))
    assert diff["loss"] > 1e-3 and diff["weights"] > 1e-4, diff
