"""CUDA-only precision checks (skipped without CUDA; run them on the lent GPU machine).

Each test prints the loss difference between fp32 and the precision under test over a short run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers import jobs
from tests.helpers.tiny import lm_dataset
from trainer_ext import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _model(seed: int = 0) -> LlamaForCausalLM:
    """Dimensions divisible by 16 so that float8 layers apply."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def _losses(tmp_path: Path, **flags) -> tuple[list[float], Trainer]:
    args = jobs.make_args(tmp_path, use_cpu=False, max_steps=20, learning_rate=3e-3, **flags)
    trainer = Trainer(model=_model(), args=args, train_dataset=lm_dataset(64, seq_len=32))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _losses(tmp_path_factory.mktemp("fp32"))[0]


def _report(name: str, losses: list[float], reference: list[float]) -> float:
    diff = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    print(f"\n{name}: max |loss - fp32 loss| over {len(losses)} steps = {diff:.4g} (final {losses[-1]:.4f})")
    return diff


def test_bf16_on_cuda(tmp_path: Path, fp32_losses: list[float]) -> None:
    losses, trainer = _losses(tmp_path, bf16=True)
    assert trainer.args.device.type == "cuda" and trainer.accelerator.mixed_precision == "bf16"
    assert _report("bf16", losses, fp32_losses) < 0.1
    assert losses[-1] < losses[0]


def test_fp16_with_loss_scaling(tmp_path: Path, fp32_losses: list[float]) -> None:
    losses, trainer = _losses(tmp_path, fp16=True, fp16_init_scale=1024.0, fp16_growth_interval=5)
    assert trainer.accelerator.scaler is not None
    assert _report("fp16", losses, fp32_losses) < 0.1
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


def test_fp16_overflowing_steps_are_skipped_and_counted(tmp_path: Path) -> None:
    """An absurd initial scale overflows: those steps are skipped, the LR schedule does not advance for them."""
    args = jobs.make_args(tmp_path, use_cpu=False, max_steps=6, fp16=True, fp16_init_scale=2.0**60, logging_steps=1)
    trainer = Trainer(model=_model(), args=args, train_dataset=lm_dataset(64, seq_len=32))
    trainer.train()
    skipped = trainer.accelerator.skipped_steps
    assert skipped >= 1
    assert trainer.lr_scheduler.last_epoch == trainer.state.global_step - skipped
    logged = [h["skipped_optimizer_steps"] for h in trainer.state.log_history if "skipped_optimizer_steps" in h]
    assert logged and logged[-1] == skipped


def test_fp16_amp_on_a_half_precision_model(tmp_path: Path) -> None:
    args = jobs.make_args(tmp_path, use_cpu=False, max_steps=3, fp16=True)
    trainer = Trainer(model=_model().half(), args=args, train_dataset=lm_dataset(16, seq_len=32))
    trainer.train()  # would raise "Attempting to unscale FP16 gradients" without the upcast
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters() if p.requires_grad)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="fp8 needs cc >= 8.9"
)
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_fp8_training(tmp_path: Path, fp32_losses: list[float]) -> None:
    losses, trainer = _losses(tmp_path, fp8=True)
    converted = [type(m).__name__ for m in trainer.model.modules() if "Float8" in type(m).__name__]
    assert converted, "no Linear layer was converted to float8"
    assert _report("fp8", losses, fp32_losses) < 0.2
