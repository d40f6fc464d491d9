"""LoRA under DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 on 2 gloo ranks (torchrun), against 1 process.

Each run: 4 AdamW steps of a global batch of 4 (2 ranks x 2), the final save writes the adapter only, which
reloads with ``PeftModel.from_pretrained`` and exports merged to a plain model with the logits of the trained model;
the adapter equals the one of 1 process x batch 4 (plain, and for DeepSpeed also under DeepSpeed on 1 process).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from tests.helpers.ranks import run_ranks  # noqa: E402
from tests.with_peft.lora_models import (  # noqa: E402
    adapter_state,
    lora_llama,
    max_diff,
    needs_transformers_peft_integration,
)
from tests.with_peft.peft_strategies_job import hf_reload_error, lora_job, reload_errors  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

# max |2 ranks - 1 rank| of the adapter after 4 steps, measured 0 to ~1e-7 (fp32 reduction order); bound 1e-5
PARITY = 1e-5
STRATEGIES = [
    pytest.param("ddp", "DistributedDataParallel", id="ddp"),
    pytest.param("fsdp-resume", "FSDPPeftModel", id="fsdp"),
    pytest.param("zero2-resume", "DeepSpeedEngine", id="zero2", marks=pytest.mark.deepspeed),
    pytest.param("zero3-resume", "DeepSpeedEngine", id="zero3", marks=pytest.mark.deepspeed),
]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same job on 1 process with the double batch (no strategy): its adapter."""
    trainer = lora_job(tmp_path_factory.mktemp("single") / "run", per_device_batch=4)
    adapter = {k: v.float() for k, v in adapter_state(trainer.model).items()}
    assert max_diff(adapter, adapter_state(lora_llama(0))) > 1e-3, "the job must move the adapter"
    return adapter


@pytest.mark.parametrize(("strategy", "wrapped"), STRATEGIES)
def test_lora_trains_saves_the_adapter_and_matches_one_process(
    strategy: str, wrapped: str, one_process: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_ranks("tests.with_peft.peft_strategies_job", 2, str(tmp_path), strategy)
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["wrapped"] == wrapped and result["steps"] == 4
    assert result["base_change"] == 0.0, "a frozen base weight changed"
    # the final save is the adapter only (no base model), gathered to the values the ranks trained
    assert "adapter_model.safetensors" in result["files"] and "adapter_config.json" in result["files"]
    assert not any(name.startswith("model") for name in result["files"]), result["files"]
    assert result["saved_keys"] == sorted(adapter_state(lora_llama(0))), "not exactly the adapter's tensors"
    assert result["save_vs_memory"] == 0.0

    expected = load_file(str(tmp_path / "logits.safetensors"))["logits"]
    errors = reload_errors(tmp_path / "run", tmp_path / "merged", expected)
    print(f"LoRA {strategy}: reload / merged logits vs the trained model: {errors}")
    assert errors["merged_type"] == "LlamaForCausalLM"
    assert errors["reload_logits"] < 1e-5 and errors["merged_logits"] < 1e-5

    adapter = load_file(str(tmp_path / "adapter.safetensors"))
    error = max_diff(adapter, one_process)
    print(f"LoRA {strategy} parity: max |2 ranks x 2 - 1 process x 4| = {error:.2e}")
    assert error < PARITY
    if wrapped == "DeepSpeedEngine":  # DeepSpeed runs on 1 process too: the same backend, 1 x 4
        run_ranks("tests.with_peft.peft_strategies_job", 1, str(tmp_path / "one"), strategy.removesuffix("-resume"))
        one = load_file(str(tmp_path / "one" / "adapter.safetensors"))
        same_backend = max_diff(adapter, one)
        print(f"LoRA {strategy} parity: max |2 ranks x 2 - 1 DeepSpeed process x 4| = {same_backend:.2e}")
        print(f"LoRA {strategy}: max |1 DeepSpeed process - 1 plain process| = {max_diff(one, one_process):.2e}")
        assert same_backend < PARITY
    if strategy.endswith("-resume"):  # stopped at checkpoint-2 and resumed: the adapter of the uninterrupted run
        resumed = max_diff(load_file(str(tmp_path / "resumed.safetensors")), adapter)
        print(f"LoRA {strategy}: max |resumed - uninterrupted| = {resumed:.2e}")
        assert resumed == 0.0
    if strategy == "fsdp-resume":  # every unit manages trainable or frozen parameters, never both
        units = result["fsdp_units"]
        assert units and all(len(flags) == 1 for _, flags, _ in units), [u for u in units if len(u[1]) != 1]
        lora_units = sorted(name for name, flags, _ in units if flags == [True])
        assert lora_units and all(".lora_A." in n or ".lora_B." in n for n in lora_units), lora_units
        assert len(lora_units) == sum(
            1 for n, _ in lora_llama(0).named_modules() if n.endswith(("lora_A.default", "lora_B.default"))
        )
    if strategy == "fsdp-resume":  # the sharded checkpoint holds the adapter only, under the model's own names
        sharded = json.loads((tmp_path / "checkpoint.json").read_text())["model_sharded"]
        assert sharded == sorted(k for k, p in lora_llama(0).named_parameters() if p.requires_grad), sharded[:3]


@needs_transformers_peft_integration
def test_an_adapter_added_through_transformers_is_saved_alone_under_fsdp(tmp_path: Path) -> None:
    """``model.add_adapter(LoraConfig)`` under FSDP2: the final save holds the adapter only and reloads by
    ``load_adapter`` to the logits of the trained, sharded model."""
    run_ranks("tests.with_peft.peft_strategies_job", 2, str(tmp_path), "fsdp-hf")
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["wrapped"] == "FSDPLlamaForCausalLM" and result["steps"] == 4
    assert result["base_change"] == 0.0
    assert "adapter_model.safetensors" in result["files"] and "model.safetensors" not in result["files"]
    assert result["save_vs_memory"] == 0.0
    assert all(len(flags) == 1 for _, flags, _ in result["fsdp_units"]), result["fsdp_units"]
    expected = load_file(str(tmp_path / "logits.safetensors"))["logits"]
    assert hf_reload_error(tmp_path / "run", expected) < 1e-5
