"""Tier 1: autocast around forward (bf16 on CPU), fp32 outputs, idempotent patching, no scaler on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from tests.helpers.tiny import VOCAB, tiny_llama
from trainer_ext.distributed import Precision

CPU = torch.device("cpu")


class Probe(torch.nn.Module):
    """A Linear that records the dtype it computes in; returns a tensor, a nested dict or ints."""

    def __init__(self, kind: str = "tensor") -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.kind = kind
        self.inner_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor):
        y = self.linear(x)
        self.inner_dtypes.append(y.dtype)
        if self.kind == "tensor":
            return y
        return {"y": y, "more": (y * 2, torch.arange(2)), "note": "n"}


@pytest.mark.parametrize("mode", ["fp32", "BF16", "float16", "", "none"])
def test_invalid_mode(mode: str) -> None:
    with pytest.raises(ValueError, match="mixed precision must be one of"):
        Precision(mode, CPU)


@pytest.mark.parametrize(
    "mode, dtype, enabled", [("no", None, False), ("bf16", torch.bfloat16, True), ("fp16", torch.float16, True)]
)
def test_modes_on_cpu_have_no_scaler(mode: str, dtype: torch.dtype | None, enabled: bool) -> None:
    precision = Precision(mode, CPU)
    assert precision.dtype == dtype and precision.enabled is enabled
    assert precision.scaler is None
    loss = torch.tensor(2.0)
    assert precision.scale(loss) is loss
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    optimizer = torch.optim.SGD([param], lr=0.5)
    precision.unscale_(optimizer)
    assert param.grad.tolist() == [1.0, 1.0]
    assert precision.step(optimizer) is False  # stepped, not skipped
    assert param.tolist() == [0.5, 0.5]


def test_autocast_context() -> None:
    with Precision("bf16", CPU).autocast():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.nn.functional.linear(torch.ones(1, 2), torch.ones(3, 2)).dtype == torch.bfloat16
    with Precision("no", CPU).autocast():
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("kind", ["tensor", "dict"])
def test_patch_forward_bf16(kind: str) -> None:
    model = Probe(kind)
    x = torch.randn(2, 4)
    reference = model(x)
    assert model.inner_dtypes == [torch.float32]
    Precision("bf16", CPU).patch_forward(model)
    out = model(x)
    assert model.inner_dtypes[-1] == torch.bfloat16  # the Linear ran in bf16 inside ...
    if kind == "tensor":
        assert out.dtype == torch.float32  # ... the caller gets fp32 back
        torch.testing.assert_close(out, reference, atol=0.05, rtol=0.05)
    else:
        assert type(out) is dict and out["note"] == "n"
        assert out["y"].dtype == out["more"][0].dtype == torch.float32
        assert type(out["more"]) is tuple and out["more"][1].dtype == torch.long  # ints stay ints
    assert model._original_forward.__func__ is Probe.forward
    assert model._trainer_ext_autocast == "bf16"


def test_patch_forward_is_idempotent() -> None:
    model = Probe()
    precision = Precision("bf16", CPU)
    precision.patch_forward(model)
    first = model.forward
    assert precision.patch_forward(model) is model
    spy = Precision("bf16", CPU)
    entered = []
    real_autocast = spy.autocast
    spy.autocast = lambda: entered.append(1) or real_autocast()
    assert spy.patch_forward(model) is model
    assert model.forward is first  # not wrapped a second time ...
    assert model(torch.ones(1, 4)).dtype == torch.float32
    assert entered == []  # ... so the second precision's autocast is never entered
    assert model.inner_dtypes == [torch.bfloat16]
    assert model._original_forward.__func__ is Probe.forward


def test_patch_forward_no_leaves_forward_untouched() -> None:
    model = Probe()
    assert Precision("no", CPU).patch_forward(model) is model
    assert "forward" not in vars(model)
    assert not hasattr(model, "_original_forward")
    assert model(torch.ones(1, 4)).dtype == torch.float32
    assert model.inner_dtypes == [torch.float32]


def test_patch_forward_tiny_llama() -> None:
    model = tiny_llama()
    inner: list[torch.dtype] = []
    model.lm_head.register_forward_hook(lambda module, args, output: inner.append(output.dtype))
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    Precision("bf16", CPU).patch_forward(model)
    assert hasattr(model, "_original_forward")
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert inner == [torch.float32, torch.bfloat16]
    assert type(out) is CausalLMOutputWithPast  # the ModelOutput class survives
    assert out.logits.dtype == torch.float32 and out["logits"].dtype == torch.float32
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    assert out.to_tuple()[1].dtype == torch.float32
    torch.testing.assert_close(out.logits, reference, atol=0.1, rtol=0.1)


def test_deepcopy_of_patched_model_uses_its_own_weights() -> None:
    model = Probe()
    Precision("bf16", CPU).patch_forward(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.linear.weight.zero_()
        clone.linear.bias.zero_()
    assert clone(torch.ones(1, 4)).abs().sum().item() == 0.0
