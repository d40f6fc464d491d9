"""DeepSpeedStrategy on 2 real gloo ranks (DS_ACCELERATOR=cpu): ZeRO 0-3 and offload against plain DDP.

One torchrun launch runs every job (ds_strategy_job.py); the tests read what rank 0 wrote. The runs are
fp32 on CPU, so the only difference to DDP is the order of floating-point reductions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.strategies import ds_strategy_job as job
from tests.helpers.ranks import child_env, run_ranks

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.timeout(600)]

# fp32 reduction order (reduce-scatter vs all-reduce, partitioned vs whole-tensor Adam) moves the last bits;
# six AdamW steps amplify that to ~4e-7 (measured), the tolerances leave 25x headroom
LOSS_TOL = 1e-5
WEIGHT_TOL = 1e-5


@pytest.fixture(scope="module")
def ds_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deepspeed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")
        run_ranks(job, 2, str(out), timeout=500)
    return out


@pytest.fixture(scope="module")
def results(ds_ranks: Path) -> dict:
    return json.loads((ds_ranks / "results.json").read_text())


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("preset", job.RUNS)
def test_stage_matches_ddp(ds_ranks: Path, results: dict, preset: str) -> None:
    """Loss per step, gradient norm per step and final weights equal DDP's within the tolerances."""
    ddp = load_file(str(ds_ranks / "ddp.safetensors"))
    assert _max_diff(ddp, job.tiny_llama(0).state_dict()) > 1e-2, "the run must move the weights"
    weights = load_file(str(ds_ranks / f"{preset}.safetensors"))
    weight_error = _max_diff(weights, ddp)
    loss_error = max(abs(a - b) for a, b in zip(results[preset]["losses"], results["ddp"]["losses"], strict=True))
    print(f"\n{preset}: max abs error vs DDP — loss {loss_error:.2e}, weights {weight_error:.2e}")
    assert loss_error < LOSS_TOL
    assert weight_error < WEIGHT_TOL
    assert len(results[preset]["losses"]) == job.STEPS
    torch.testing.assert_close(results[preset]["grad_norms"], results["ddp"]["grad_norms"], rtol=1e-5, atol=0)
    assert min(results["ddp"]["grad_norms"]) > job.CLIP, "clipping must be active for the comparison to test it"


def test_optimizer_and_scheduler_blocks_of_the_json_are_used(ds_ranks: Path, results: dict) -> None:
    """No optimizer/scheduler passed: DeepSpeed builds them from the config's blocks ("auto" parameters)."""
    run = results[job.CONFIG_BLOCKS_RUN]
    assert (run["optimizer"], run["scheduler"]) == ("AdamW", "WarmupDecayLR")
    reference = load_file(str(ds_ranks / "ddp_warmup_decay.safetensors"))
    weights = load_file(str(ds_ranks / f"{job.CONFIG_BLOCKS_RUN}.safetensors"))
    weight_error = _max_diff(weights, reference)
    ref_losses = results["ddp_warmup_decay"]["losses"]
    loss_error = max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True))
    print(
        f"\nzero2 + JSON optimizer/scheduler: max abs error vs DDP — loss {loss_error:.2e}, weights {weight_error:.2e}"
    )
    assert loss_error < LOSS_TOL
    assert weight_error < WEIGHT_TOL
    torch.testing.assert_close(run["grad_norms"], results["ddp_warmup_decay"]["grad_norms"], rtol=1e-5, atol=0)
    assert _max_diff(reference, load_file(str(ds_ranks / "ddp.safetensors"))) > 1e-3  # the schedules differ


@pytest.mark.parametrize("preset", [*job.RUNS, job.CONFIG_BLOCKS_RUN])
def test_scheduler_steps_once_per_optimizer_step(results: dict, preset: str) -> None:
    """The final LR equals the DDP reference's after 6 scheduler steps (12 would give another value)."""
    reference = results["ddp_warmup_decay" if preset == job.CONFIG_BLOCKS_RUN else "ddp"]["lr_after"]
    assert results[preset]["lr_after"] == pytest.approx(reference, abs=1e-12)
    assert results["ddp"]["lr_after"] == 0.0 and results["ddp_warmup_decay"]["lr_after"] == pytest.approx(0.0025)


@pytest.mark.parametrize("preset", ["zero2", "zero3"])
def test_resume_equals_uninterrupted(ds_ranks: Path, results: dict, preset: str) -> None:
    """save_checkpoint at step 3, a fresh engine from other weights, load_checkpoint, 3 more steps."""
    resumed = results[f"{preset}_resume"]
    assert resumed["client_step"] == 3
    assert resumed["lr_after"] == pytest.approx(0.0, abs=1e-12)
    assert resumed["losses"] == results[preset]["losses"]
    full = load_file(str(ds_ranks / f"{preset}.safetensors"))
    again = load_file(str(ds_ranks / f"{preset}_resumed.safetensors"))
    for name in full:
        assert torch.equal(full[name], again[name]), name  # bitwise: same ops in the same order on CPU


def test_zero3_consolidated_state_dict_is_complete(ds_ranks: Path, results: dict) -> None:
    """Every parameter gathered in full, equal to the unpartitioned (stage-0) result."""
    zero3 = results["zero3"]
    assert zero3["partitioned"] == len(list(job.tiny_llama(0).parameters()))
    assert zero3["consolidated_keys"] == len(job.tiny_llama(0).state_dict())
    assert zero3["consolidated_numel"] == zero3["model_numel"] == 22688
    stage0 = load_file(str(ds_ranks / "zero0.safetensors"))
    consolidated = load_file(str(ds_ranks / "zero3.safetensors"))
    assert _max_diff(consolidated, stage0) < WEIGHT_TOL


def test_plain_zero3_state_dict_would_be_empty_and_is_refused(results: dict) -> None:
    """The classic empty ZeRO-3 save: module.state_dict() holds 0-size placeholders; the check refuses it."""
    zero3 = results["zero3"]
    assert zero3["raw_state_dict_numel"] < zero3["model_numel"] // 10
    assert "incomplete" in zero3["raw_state_dict_refused"]


def test_zero3_export_loads_in_plain_from_pretrained(ds_ranks: Path) -> None:
    """The consolidated ZeRO-3 save is an ordinary checkpoint: same weights, same logits without DeepSpeed."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()
    loaded = AutoModelForCausalLM.from_pretrained(ds_ranks / "zero3_export")
    reference = job.tiny_llama(0)
    reference.load_state_dict(load_file(str(ds_ranks / "zero3.safetensors")))
    ids = job.IDS[:4]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_from_pretrained_builds_partitioned_model_under_zero3(results: dict) -> None:
    info = results["from_pretrained"]
    assert info["enabled"] == [False, True, False]  # registered only between register and unregister
    assert info["partitioned"] == info["params"] > 0
    assert info["max_abs_error"] == 0.0
    assert info["init_context_partitioned"]  # strategy.zero3_init_context() partitions at construction


def test_stage3_holds_less_per_rank_than_stage0(ds_ranks: Path, results: dict) -> None:
    """Parameters + optimizer state per rank (each storage once): ZeRO-3 over 2 ranks vs full replicas."""
    per_rank = json.loads((ds_ranks / "held_bytes.json").read_text())
    for rank in per_rank:
        ratio = rank["zero3"] / rank["zero0"]
        print(
            f"\nper-rank params+optimizer: stage 0 {rank['zero0']} B, stage 1 {rank['zero1']} B, "
            f"stage 2 {rank['zero2']} B, stage 3 {rank['zero3']} B; stage3/stage0 = {ratio:.3f}"
        )
        assert ratio < 0.6
    assert per_rank[0]["zero0"] >= 3 * 22688 * 4  # fp32 weights + two Adam moments, all replicated


def test_single_process_without_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun: the strategy creates an in-memory one-rank group; ZeRO-3 trains and consolidates."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    command = [sys.executable, "-m", job.__name__, "--single", str(tmp_path)]
    proc = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    info = json.loads((tmp_path / "single.json").read_text())
    assert info["world_size"] == 1 and info["local_rank_env"] == "0"
    assert info["losses"][-1] < info["losses"][0]
    assert info["grad_norm"] > 0 and info["keys"] == len(job.tiny_llama(0).state_dict())
    assert info["wrap_unwraps_to"] == "LlamaForCausalLM" and info["wrap_logits_error"] < 1e-6
    assert info["group_after_destroy"] is False
