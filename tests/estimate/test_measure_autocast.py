"""How ``--measure`` sorts saved tensors under autocast: weight copies apart from activations, views included."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from trainer_ext.cli.main import main
from trainer_ext.estimate.measure import SavedTensors

LLAMA = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    tie_word_embeddings=False,
)


def _llama() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **LLAMA)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _linear_params(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def _param_storages(model: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def test_autocast_weight_copies_are_not_activations() -> None:
    model = _llama()
    ids = torch.randint(0, 300, (2, 16))
    with SavedTensors() as fp32:
        model(input_ids=ids, labels=ids)
    with torch.autocast("cpu", dtype=torch.bfloat16), SavedTensors() as bf16:
        model(input_ids=ids, labels=ids)
    # each Linear weight's bf16 copy (saved as its transpose, a view) once, 2 bytes per parameter
    assert sum(bf16.weight_copies.values()) == 2 * _linear_params(model)
    assert not set(bf16.weight_copies) & set(bf16.activations)
    # without autocast the weights are saved as views of the parameters themselves: neither class holds them
    assert not fp32.weight_copies
    assert not set(fp32.activations) & _param_storages(model)
    # the bf16 activations are fewer bytes than the fp32 ones (they would exceed them with the copies counted in)
    assert 0 < bf16.total < fp32.total


def test_a_view_of_a_cast_activation_stays_an_activation() -> None:
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(8, 8, requires_grad=True)
    with SavedTensors() as saved:
        hidden = (x * 2).to(torch.bfloat16)  # a cast whose source is an activation, not a weight
        torch.mm(hidden.t(), weight.to(torch.bfloat16).t())  # saves views of both casts
    assert len(saved.weight_copies) == 1 and sum(saved.weight_copies.values()) == 8 * 8 * 2
    cast_activation = hidden.untyped_storage().data_ptr()
    assert cast_activation in saved.activations and cast_activation not in saved.weight_copies


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_measure_bf16_reports_the_weight_copies(tmp_path) -> None:
    out = tmp_path / "estimate.json"
    argv = ["estimate", "--model_config", "tiny-llama", "--task", "causal-lm", "--num_processes", "2", "--measure"]
    assert main([*argv, "--per_device_train_batch_size", "8", "--bf16", "--json", str(out)]) == 0
    measured = json.loads(out.read_text())["measured"]
    # every parameter but the norms' goes through a Linear: its bf16 copy is about half the fp32 weights' bytes
    for rank in measured["ranks"]:
        assert 0.49 * rank["weights"] <= rank["weight_copies"] <= 0.5 * rank["weights"], rank
        assert rank["total"] == sum(rank[k] for k in ("weights", "gradients", "optimizer", "activations")), rank
