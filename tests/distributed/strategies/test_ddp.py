"""2 real gloo ranks under torchrun against the same jobs on 1 rank in this process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import jobs
from tests.helpers.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.compat, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    proc = run_ranks(jobs, 2, str(out))
    (out / "stdout.txt").write_text(proc.stdout)
    return out


def test_two_ranks_equal_one_rank_with_double_batch(two_ranks: Path, tmp_path: Path) -> None:
    """2 ranks x batch 2 == 1 rank x batch 4 after 20 AdamW steps (tolerance 1e-5, fp32 reduction order)."""
    ddp = load_file(str(two_ranks / "parity.safetensors"))
    single = jobs.parity_job(tmp_path, per_device_batch=4)
    initial = jobs.tiny_llama(0).state_dict()
    assert jobs.max_abs_diff(single, initial) > 1e-2, (
        "the job must move the weights for the comparison to mean anything"
    )
    assert jobs.max_abs_diff(ddp, single) < 1e-5


def test_ddp_mid_epoch_resume_is_bitwise_equal(two_ranks: Path) -> None:
    info = json.loads((two_ranks / "results.json").read_text())["resume"]
    assert info["interrupted_at"] == 4 and info["steps_resumed"] == info["steps_full"] == 12
    full = load_file(str(two_ranks / "resume_full.safetensors"))
    resumed = load_file(str(two_ranks / "resume_resumed.safetensors"))
    for name in full:
        assert torch.equal(full[name], resumed[name]), name


def test_ddp_eval_counts_every_sample_once(two_ranks: Path, tmp_path: Path) -> None:
    """7 samples on 2 ranks: the duplicated sample that evens the last round is dropped."""
    metrics = json.loads((two_ranks / "results.json").read_text())["eval"]
    data = jobs.lm_dataset(7, seed=5)
    assert metrics["eval_n_samples"] == 7
    assert metrics["eval_label_sum"] == int(np.asarray(data["labels"]).sum())
    single = jobs.eval_job(tmp_path)
    assert single["metrics"]["eval_n_samples"] == 7
    ddp_predictions = np.load(two_ranks / "predictions.npy")
    assert ddp_predictions.shape == single["predictions"].shape
    np.testing.assert_allclose(ddp_predictions, single["predictions"], atol=1e-5)


@pytest.fixture(scope="module")
def one_rank_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, jobs.ParityRun]:
    out = tmp_path_factory.mktemp("ga_ref")
    return {
        "fp32": jobs.accumulation_parity_job(out / "fp32", per_device_batch=8, grad_accum=1),
        "bf16": jobs.accumulation_parity_job(out / "bf16", per_device_batch=8, grad_accum=1, bf16=True),
    }


def _two_rank_run(two_ranks: Path, name: str) -> jobs.ParityRun:
    return jobs.ParityRun(
        load_file(str(two_ranks / f"{name}.safetensors")),
        load_file(str(two_ranks / f"{name}_gradients.safetensors")),
        json.loads((two_ranks / "results.json").read_text())[name],
    )


def test_accumulation_parity_fp32(two_ranks: Path, one_rank_reference: dict) -> None:
    """2 ranks x micro-batch 2 x accumulation 2 == 1 rank x batch 8 on ragged padded causal-LM batches.

    Same first-step gradients (after the all-reduce), per-step losses and grad norms, and final weights
    after 12 plain-SGD steps without clipping, so a constant factor on the gradients cannot hide.
    Measured errors ~1e-7; a x3 loss scale gives ~0.2 on the gradients.
    """
    ddp, ref = _two_rank_run(two_ranks, "ga_fp32"), one_rank_reference["fp32"]
    jobs.assert_fp32_parity(ddp, ref, weights_tol=2e-5)


def test_accumulation_parity_bf16(two_ranks: Path, one_rank_reference: dict) -> None:
    """Under bf16 the same split differs from 1 rank by no more than bf16 itself differs from fp32."""
    ddp, ref, fp32 = _two_rank_run(two_ranks, "ga_bf16"), one_rank_reference["bf16"], one_rank_reference["fp32"]
    bf16_noise = jobs.parity_errors(ref, fp32)
    errors = jobs.parity_errors(ddp, ref)
    assert errors["gradients"] <= 2 * bf16_noise["gradients"] + 1e-4, (errors, bf16_noise)
    assert errors["weights"] <= 2 * bf16_noise["weights"] + 1e-3, (errors, bf16_noise)
    assert errors["losses"] <= 2 * bf16_noise["losses"] + 5e-3, (errors, bf16_noise)
    assert errors["grad_norms"] <= 2 * bf16_noise["grad_norms"] + 1e-2, (errors, bf16_noise)


def test_gradients_are_all_reduced_once_per_window(two_ranks: Path) -> None:
    """4 micro-batches per optimizer step: the DDP all-reduce runs on the last one only (one bucket)."""
    info = json.loads((two_ranks / "results.json").read_text())["allreduce"]
    assert info["optimizer_steps"] == 8 and info["micro_batches"] == 32
    assert info["allreduce_calls"] == 8


def test_scheduler_steps_once_per_optimizer_step_on_two_ranks(two_ranks: Path) -> None:
    info = json.loads((two_ranks / "results.json").read_text())["ga_fp32"]
    assert info["global_step"] == 12  # 48 samples / (2 ranks x 2 x 2) x 2 epochs
    assert info["scheduler_steps"] == 12


def test_compile_after_evaluate_still_trains_with_ddp(two_ranks: Path) -> None:
    info = json.loads((two_ranks / "results.json").read_text())["compile"]
    assert info["wrapped"] == "DistributedDataParallel"
    assert info["checksums"][0] == info["checksums"][1], "the ranks' weights diverged: gradients were not synced"


def test_reloaded_training_args_take_the_rank_of_the_loading_process(two_ranks: Path) -> None:
    ranks = json.loads((two_ranks / "results.json").read_text())["reloaded_args"]
    assert ranks == [[0, 2], [1, 2]]


def test_two_ranks_run_in_distributed_mode_and_only_rank_0_prints_the_start_up_block(two_ranks: Path) -> None:
    ranks = json.loads((two_ranks / "results.json").read_text())["start_up"]["ranks"]
    assert [r["parallel_mode"] for r in ranks] == ["ParallelMode.DISTRIBUTED"] * 2
    main, replica = (r["printed"] for r in ranks)
    assert replica is None, "rank 1 must not print the start-up block"
    assert "world size              = 2 (ddp)" in main
    assert "global batch (samples)  = 12 = 2 x 3 x 2" in main
    assert "precision               = bf16" in main
    stdout = (two_ranks / "stdout.txt").read_text()
    assert stdout.count("global batch (samples)  = 12 = 2 x 3 x 2") == 1, "printed once, by rank 0 only"
