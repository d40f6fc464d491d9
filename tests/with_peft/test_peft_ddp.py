"""LoRA under DDP on 2 real gloo ranks (torchrun) against the same job on 1 rank with the double batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from tests.helpers.ranks import run_ranks  # noqa: E402
from tests.with_peft.lora_models import adapter_state, lora_llama, max_diff  # noqa: E402
from tests.with_peft.peft_ranks_job import lora_parity_job  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def test_two_ranks_train_the_adapter_of_one_rank_with_the_double_batch(tmp_path: Path) -> None:
    """2 ranks x batch 2 == 1 rank x batch 4 after 8 AdamW steps (tolerance 1e-5: fp32 reduction order)."""
    run_ranks("tests.with_peft.peft_ranks_job", 2, str(tmp_path / "ddp"))
    result = json.loads((tmp_path / "ddp" / "results.json").read_text())
    assert result["wrapped"] == "DistributedDataParallel" and result["steps"] == 8
    assert result["checksums"][0] == result["checksums"][1], "the ranks' adapters diverged"
    assert result["base_change"] == 0.0, "a frozen base weight changed under DDP"
    ddp = load_file(str(tmp_path / "ddp" / "adapter.safetensors"))
    # the final save by rank 0 is the trained adapter, under the names peft reloads
    assert max_diff(load_file(str(tmp_path / "ddp" / "run" / "adapter_model.safetensors")), ddp) == 0.0

    single = adapter_state(lora_parity_job(tmp_path / "single", per_device_batch=4).model)
    assert max_diff(single, adapter_state(lora_llama(0))) > 1e-2, "the job must move the adapter"
    error = max_diff(ddp, single)
    print(f"LoRA DDP parity: max |2 ranks - 1 rank| = {error:.2e}")
    assert error < 1e-5
