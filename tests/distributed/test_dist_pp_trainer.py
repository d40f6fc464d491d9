"""The Trainer under pipeline parallelism on real gloo ranks against one process: a tiny float64 Llama on SDPA
(4 layers, hidden 32, untied embeddings) split over pp 2 on each of the six schedules (one or two stages per rank),
and over pp 2 × dp_shard 2 (FSDP2 per stage), at the same global batch of 8 ragged, right-padded rows per optimizer
step (per-device batches of 2, accumulation 4 or 2 on 1 or 2 data-parallel ranks; the pp ranks of a group share a
batch, split into the schedule's microbatches: with two stages a rank, 4 microbatches of 2 rows, half of them
empty).

Ten optimizer steps with clipping at 0.5 and the Trainer's fused AdamW. The model is float64, but transformers
computes the loss in float32, and each microbatch's token losses are summed apart: losses, gradient norms and
weights agree with one process to ~1e-6 and are held to :data:`PARITY`; a checkpoint resumed on another layout to
:data:`ACROSS`. Logits of the same weights (the export against the pipeline's forward) to :data:`EXACT`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.nd_runs import assert_resumed_bitwise, run_diff, seen
from tests.distributed.pp_runs import OTHER_SCHEDULES, launched, source

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

PARITY, ACROSS, EXACT = 1e-5, 1e-6, 1e-9
TRAINED = ["pp2", *(f"pp2_{s}" for s in OTHER_SCHEDULES), "pp_dp", "pp_tp"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "pp"


def assert_close(diff: dict[str, float], bound: float, what: object) -> None:
    assert max(diff.values()) <= bound, (what, diff)


@pytest.mark.parametrize("mesh", TRAINED)
def test_training_matches_one_process(root: Path, mesh: str) -> None:
    got, one = seen(launched(root, mesh), "train"), seen(launched(root, "one"), "train")
    assert got["steps"] == one["steps"] == 10 and len(got["norms"]) == len(got["losses"]) == 10
    assert min(got["norms"]) > 0.5  # every step clips
    assert got["weights"].keys() == one["weights"].keys()
    assert_close(run_diff(got, one), PARITY, mesh)
    assert got["losses"][-1] < got["losses"][0] - 0.2  # it trained


@pytest.mark.parametrize("mesh", ["pp2", "pp_dp"])
def test_resume_on_the_same_mesh_is_bitwise(root: Path, mesh: str) -> None:
    """A fresh Trainer resumed from checkpoint-5 of the uninterrupted run on the same mesh ends where it ended."""
    assert_resumed_bitwise(launched(root, mesh))


@pytest.mark.parametrize("mesh", ["one", "pp_dp", "pp2_interleaved_1f1b", "fsdp", "pp2_gpipe"])
def test_resume_on_another_mesh(root: Path, mesh: str) -> None:
    """pp 2's checkpoint-5 resumed on one process, on pp 2 with interleaved 1F1B (two stages a rank) and on FSDP2
    alone; one process's on pp 2 × dp_shard 2 with interleaved 1F1B; FSDP2's on pp 2 with GPipe: steps 6-10 as the
    run that wrote the checkpoint took them."""
    uninterrupted = seen(launched(root, source(mesh)), "train")
    resumed = seen(launched(root, mesh), "from")
    assert resumed["steps"] == 10
    assert resumed["losses"][:5] == uninterrupted["losses"][:5]  # the checkpoint's history
    assert_close(run_diff(resumed, uninterrupted), ACROSS, mesh)


@pytest.mark.parametrize("mesh", ["pp2", "pp2_interleaved_1f1b", "pp_dp", "pp_tp"])
def test_the_export_reloads_on_one_process(root: Path, mesh: str) -> None:
    """save_model writes one consolidated model.safetensors of every stage; from_pretrained on rank 0 alone holds
    the trained weights exactly (float64) and gives the logits the pipeline's forward gives."""
    out = launched(root, mesh)
    got, weights = seen(out, "export"), seen(out, "train")["weights"]
    assert "model.safetensors" in got["files"]
    assert not [f for f in got["files"] if f.startswith("model-") or f.endswith(".index.json")]
    assert got["keys"] == sorted(weights)
    assert not got["unequal"], got["unequal"]
    assert got["logits_diff"] <= EXACT


@pytest.mark.parametrize("mesh", ["pp2", "pp_dp", "zbv_eval"])
def test_evaluation_matches_one_process(root: Path, mesh: str) -> None:
    """13 ragged rows in global batches of 4 (pp 2 × dp_shard 2: 2 a rank, so the same rows; the last batch has
    fewer rows than microbatches, and under dp_shard 2 mixes real and repeated rows): the exact ``eval_loss`` as one
    process has it (on pp 2, whose batches are one process's, the mean of batch means too), and ``predict``'s
    logits at every labelled position, rows in order."""
    got, one = seen(launched(root, mesh), "eval"), seen(launched(root, "one"), "eval")
    assert abs(got["eval_loss_True"] - one["eval_loss_True"]) <= PARITY
    if mesh != "pp_dp":  # the same batches as one process's
        assert abs(got["eval_loss_False"] - one["eval_loss_False"]) <= PARITY
    labels = [[t for t in row if t != -100] for row in got["label_ids"]]
    assert labels == [list(r) for r in got["rows"]]
    mask = torch.tensor(got["label_ids"]) != -100
    assert torch.equal(mask, torch.tensor(one["label_ids"]) != -100)
    assert got["predictions"].shape == one["predictions"].shape
    assert (got["predictions"][mask] - one["predictions"][mask]).abs().max().item() <= PARITY


REFUSED = {
    "tied": "pipeline parallelism: LlamaForCausalLM ties lm_head to its input embeddings, which the first and last "
    "stages hold apart; set pp_size=1 (or untie/change the model)",
    "gpt2": "pipeline parallelism: GPT2LMHeadModel (gpt2) is not a decoder the pipeline splits: it splits causal-LM "
    "models of llama, mistral, qwen2, qwen3; set pp_size=1 (or untie/change the model)",
    "compute_loss": "pipeline parallelism computes the causal-LM loss on the last stage; OwnLoss computes its own "
    "(compute_loss or compute_loss_func): set pp_size=1",
    "columns": "pipeline parallelism takes input_ids, attention_mask, position_ids and labels; this batch also has "
    "token_type_ids: drop those columns (remove_unused_columns) or set pp_size=1",
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_the_pipeline_cannot_run_is_refused_before_the_first_step(root: Path, case: str) -> None:
    kind, message, steps = seen(launched(root, "pp2"), "refusals")[case]
    assert (kind, message) == ("ConfigError", REFUSED[case])
    assert steps in (0, None)
