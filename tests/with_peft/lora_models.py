"""Tiny LoRA models for the peft tests: a config-built Llama with adapters on its attention projections."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch
from packaging.version import Version
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from peft import PeftModel as PeftModel  # re-exported for the tests
from transformers.integrations import peft as transformers_peft

from tests.helpers.tiny import tiny_llama

# transformers' own peft integration (``model.add_adapter``) refuses a peft older than its MIN_PEFT_VERSION (5.24:
# 0.22.0, which was not released when this was written; the index's newest was 0.21.2). Stock transformers fails
# the same way there, so those tests wait for a peft that transformers accepts.
_PEFT_FOR_TRANSFORMERS = getattr(transformers_peft, "MIN_PEFT_VERSION", "0")
needs_transformers_peft_integration = pytest.mark.skipif(
    Version(metadata.version("peft")) < Version(_PEFT_FOR_TRANSFORMERS),
    reason=f"transformers' model.add_adapter needs peft>={_PEFT_FOR_TRANSFORMERS}; peft {metadata.version('peft')} "
    "is installed",
)

IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])


def lora_config() -> LoraConfig:
    """Rank-4 LoRA on q_proj and v_proj, no dropout (so training is deterministic)."""
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def lora_llama(seed: int = 0, adapter_name: str = "default") -> PeftModel:
    """``tiny_llama(seed)`` wrapped by ``get_peft_model``; the adapter's initial weights are fixed by ``seed`` too."""
    return get_peft_model(tiny_llama(seed), lora_config(), adapter_name=adapter_name)


def adapter_state(model: torch.nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors as ``save_pretrained`` writes them (copies)."""
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The non-adapter tensors of a LoRA model, under the base model's own names (copies)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {k.replace(".base_layer", ""): v.detach().clone() for k, v in base.state_dict().items() if "lora_" not in k}


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    """Logits of a fixed sequence in eval mode."""
    return model.eval()(input_ids=IDS).logits


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same names."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max(float((a[k] - b[k]).abs().max()) for k in a)
