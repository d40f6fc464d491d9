"""The callbacks on 2 real gloo ranks: one torchrun launch of callbacks_ranks.py, checked here piece by piece."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from tests.helpers.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    out = tmp_path_factory.mktemp("callbacks")
    proc = run_ranks("tests.callbacks.callbacks_ranks", 2, str(out), timeout=200)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return SimpleNamespace(out=out, stdout=proc.stdout, ranks=ranks)


def _train_logs(rank: dict) -> list[dict]:
    return [entry for entry in rank["log_history"] if "loss" in entry]


def test_logged_loss_is_the_mean_of_the_ranks_losses(two_ranks: SimpleNamespace) -> None:
    """Logging every 2 steps: each logged loss = mean over ranks of that rank's mean loss over the 2 steps."""
    per_rank = [r["step_losses"] for r in two_ranks.ranks]
    logged = _train_logs(two_ranks.ranks[0])
    assert [e["step"] for e in logged] == [2, 4]
    for entry in logged:
        window = slice(entry["step"] - 2, entry["step"])
        means = [sum(losses[window]) / 2 for losses in per_rank]
        assert abs(means[0] - means[1]) > 1e-3, "the ranks must see different data for the check to mean anything"
        assert entry["loss"] == pytest.approx(sum(means) / 2, abs=1e-5)
    assert [e["loss"] for e in _train_logs(two_ranks.ranks[1])] == [e["loss"] for e in logged]


def test_only_the_main_process_logs_info_and_prints(two_ranks: SimpleNamespace) -> None:
    main, replica = (r["logs"] for r in two_ranks.ranks)
    assert "user info line" in main and "transformers info line" in main
    assert not any(line.startswith("[rank") for line in main)
    assert replica == [
        "[rank 1] user warning line",
        "[rank 1] transformers warning line",
        "[rank 1] job.py:1: UserWarning: python warning line",
    ]
    for entry in _train_logs(two_ranks.ranks[0]):  # PrinterCallback's line for each training log, printed once
        assert two_ranks.stdout.count(f"'loss': '{entry['loss']:.4g}'") == 1


def test_barriers_pass_at_every_stage_on_every_rank(two_ranks: SimpleNamespace) -> None:
    expected = [
        "before evaluation at step 2",
        "after evaluation at step 2",
        "after checkpoint save at step 2",
        "before evaluation at step 4",
        "after evaluation at step 4",
        "after checkpoint save at step 4",
        "at the end of training (step 4)",
    ]
    assert [r["barriers"] for r in two_ranks.ranks] == [expected, expected]


def test_a_late_rank_is_named_with_the_stage(two_ranks: SimpleNamespace) -> None:
    """Rank 1 sleeps 4 s before the checkpoint barrier of step 2 (timeout 1.5 s)."""
    main, late = (r["late_rank"] for r in two_ranks.ranks)
    assert main.startswith("BarrierTimeoutError: ranks 1 did not reach the barrier before checkpoint save at step 2")
    assert main.endswith("missing=[1]")
    assert late.startswith("BarrierTimeoutError: rank 1 reached the barrier before checkpoint save at step 2")


def test_throughput_counts_every_rank(two_ranks: SimpleNamespace) -> None:
    """Last window: 2 steps x 2 ranks x 2 samples of 12 tokens, the same figures on both ranks."""
    windows = [r["throughput_window"] for r in two_ranks.ranks]
    assert windows[0] == windows[1]
    assert windows[0]["samples"] == 8 and windows[0]["tokens"] == 96
    last = _train_logs(two_ranks.ranks[0])[-1]
    assert last["samples_per_second"] == pytest.approx(8 / windows[0]["seconds"], rel=1e-3)
    assert last["tokens_per_second"] == pytest.approx(96 / windows[0]["seconds"], rel=1e-3)
    assert last["peak_memory_mib"] > 0


def test_ddp_checkpoints_and_final_model_are_checked_and_reload(two_ranks: SimpleNamespace) -> None:
    assert [r["verified"] for r in two_ranks.ranks] == [["checkpoint-2", "checkpoint-4", "."]] * 2
    final = two_ranks.out / "train"
    reloaded = LlamaForCausalLM.from_pretrained(final)
    trained = load_file(str(two_ranks.out / "weights.safetensors"))
    state = reloaded.state_dict()
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    assert PreTrainedTokenizerFast.from_pretrained(final).pad_token == "<pad>"


def test_nan_on_one_rank_skips_the_step_on_both(two_ranks: SimpleNamespace) -> None:
    """Rank 1's gradient of one weight is NaN at step 3: both ranks name it and skip the step, then go on."""
    events = [r["nan_events"] for r in two_ranks.ranks]
    assert events == [[[3, "model.layers.1.mlp.down_proj.weight", False]]] * 2
    sums = [r["weight_sums"] for r in two_ranks.ranks]
    assert sums[0] == sums[1]
    assert sums[0][3] == sums[0][2], "step 3 must leave the weights as step 2 left them"
    assert sums[0][4] != sums[0][3], "training goes on after the skipped step"
    assert _train_logs(two_ranks.ranks[0])[-1]["nan_guard_skipped_steps"] == 1
