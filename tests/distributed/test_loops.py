"""trainer_ext.Accelerator loops on 2 real gloo ranks against the same loops on 1 rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import loops
from tests.helpers.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("loops")
    proc = run_ranks(loops, 2, str(out))
    (out / "stdout.txt").write_text(proc.stdout)
    return out


@pytest.fixture(scope="module")
def one_rank_big_batch() -> dict[str, torch.Tensor]:
    return loops.train_loop(per_device_batch=4)[1]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_rank_loop_equals_one_rank_double_batch(two_ranks: Path, one_rank_big_batch: dict) -> None:
    assert _max_diff(load_file(str(two_ranks / "parity.safetensors")), one_rank_big_batch) < 1e-5


def test_two_rank_accumulating_loop_equals_one_rank(two_ranks: Path, one_rank_big_batch: dict) -> None:
    """2 ranks x batch 1 x accumulation 2 == 1 rank x batch 4; the scheduler stepped once per window."""
    assert _max_diff(load_file(str(two_ranks / "accum.safetensors")), one_rank_big_batch) < 1e-5
    info = json.loads((two_ranks / "results.json").read_text())["accum"]
    # accelerate's rule: 20 optimizer steps (2 epochs x 40 samples / global batch 4), the scheduler advanced once per
    # process at each, the schedule (sized from the unsharded loader) ending on time
    assert info["scheduler_steps"] == 40


def test_two_rank_save_state_resume_is_bitwise(two_ranks: Path) -> None:
    full = load_file(str(two_ranks / "full.safetensors"))
    resumed = load_file(str(two_ranks / "resumed.safetensors"))
    for name in full:
        assert torch.equal(full[name], resumed[name]), name


def test_gather_for_metrics_and_main_process_decorator(two_ranks: Path) -> None:
    results = json.loads((two_ranks / "results.json").read_text())
    assert results["gathered"] == [0, 1, 2, 10, 11, 12]
    assert results["main_only"] == 0


def test_trackers_write_on_the_main_process_only(two_ranks: Path) -> None:
    files = list((two_ranks / "tracking").rglob("events.out.tfevents*"))
    assert len(files) >= 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for path in files:
        events = EventAccumulator(str(path))
        events.Reload()
        if "rank_loss" in events.Tags()["scalars"]:
            values += [e.value for e in events.Scalars("rank_loss")]
    assert values == [0.0], "only rank 0 logs"


def test_collectives_and_process_members_on_two_ranks(two_ranks: Path) -> None:
    members = json.loads((two_ranks / "results.json").read_text())["members"]
    assert members["reduce_sum"] == [3.0] and members["reduce_mean"] == [1.5]
    assert members["gather"] == [0, 1]
    # gathering into one tensor (NCCL's form) gives what the list form gives: rank 0's rows, then rank 1's
    expected = [[0, 1], [0, 1, 2, 10, 11, 12], [[0.5] * 3, [0.5] * 3, [1.5] * 3, [1.5] * 3]]
    assert members["gather_forms"] == [[e, e] for e in expected]
    assert members["padded"] == [1.0, -1.0]  # rank 0's tensor padded to rank 1's length
    assert members["distributed_type"] == "MULTI_CPU" and members["num_processes"] == 2
    assert members["order"] == ["0", "1"], "main_process_first: the main process runs the block first"
    assert "model.safetensors" in members["saved_files"] and "config.json" in members["saved_files"]
    stdout = (two_ranks / "stdout.txt").read_text()
    assert "printed by rank 0" in stdout and "printed by rank 1" not in stdout


def test_process_members_and_save_on_two_ranks(two_ranks: Path) -> None:
    members = json.loads((two_ranks / "results.json").read_text())["members"]
    assert members["where"] == [["cpu", True, 0], ["cpu", False, 1]]  # device, is_local_main_process, local index
    assert members["save"] == {"rank_in_file": 0, "files": ["save_by_0.pt"]}, "save() writes on the main process only"
    assert members["tracker_types"] == ["TensorBoardTracker", "BlankTracker"]


def test_no_sync_and_accumulate_skip_the_all_reduce(two_ranks: Path) -> None:
    """A DDP comm hook counts gradient all-reduces: none inside ``no_sync``; one per window in ``accumulate``."""
    counts = json.loads((two_ranks / "results.json").read_text())["members"]["allreduce"]
    per_sync = counts["per_sync"]
    assert per_sync >= 1
    assert counts["no_sync"] == 0 and counts["then_sync"] == per_sync
    local, synced = counts["no_sync_grads"], counts["synced_grads"]
    assert local[0] != local[1], "inside no_sync each rank keeps its own gradients"
    assert synced[0] == pytest.approx(synced[1], rel=1e-6), "the next backward outside no_sync all-reduces them"
    assert counts["accumulate_8_of_4"] == 2 * per_sync  # 8 micro-batches, accumulation 4: 2 syncs


def test_autocast_and_unwrap_without_the_fp32_wrapper_on_two_ranks(two_ranks: Path) -> None:
    result = json.loads((two_ranks / "results.json").read_text())["members"]["autocast"]
    assert result["autocast_dtype"] == "torch.bfloat16"
    assert result["prepared"] == "DistributedDataParallel" and result["unwrapped"] == "LlamaForCausalLM"
    assert result["wrapped_dtype"] == "torch.float32" and result["wrapped_differs"] > 0  # bf16 compute, fp32 out
    assert result["unwrapped_equal"], "keep_fp32_wrapper=False: the plain fp32 forward again"
