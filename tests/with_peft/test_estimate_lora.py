"""``trainer-ext estimate --lora_r``: the meta model goes through apply_lora, only the adapters have gradients and
optimizer states."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from trainer_ext.estimate import estimate  # noqa: E402
from trainer_ext.estimate.job import job_from_argv  # noqa: E402

pytestmark = pytest.mark.peft

ARGV = ["--model_config", "tiny-llama", "--task", "causal-lm"]


def test_lora_estimates_trainable_only_gradients_and_optimizer() -> None:
    full = job_from_argv(ARGV, 1)
    lora = job_from_argv([*ARGV, "--lora_r", "4"], 1)
    assert lora.shape.params > full.shape.params  # the base model plus the adapters
    assert 0 < lora.shape.trainable < full.shape.trainable / 10
    breakdown = estimate(lora.shape, lora.setup)
    assert breakdown.gradients == 4 * lora.shape.trainable
    assert breakdown.optimizer == 8 * lora.shape.trainable
    assert breakdown.weights == 4 * lora.shape.params
