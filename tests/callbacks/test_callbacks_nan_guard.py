"""NaNGuardCallback on one process: skip keeps the weights of a poisoned step, stop ends training, both name where."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from tests.callbacks.callbacks_ranks import NAN_PARAMETER, NaNGradientAt, WeightsPerStep
from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.callbacks import NaNGuardCallback


def test_zero_gradients_are_not_a_skip_for_adamw() -> None:
    """Why a skip must not call the optimizer: AdamW moves weights with zero gradients, not with ``grad=None``."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.0)
    weight.grad = torch.ones(3)
    optimizer.step()
    before = weight.detach().clone()
    weight.grad = torch.zeros(3)
    optimizer.step()
    assert not torch.equal(weight, before), "momentum moves the weight"
    moved = weight.detach().clone()
    weight.grad = None
    optimizer.step()
    assert torch.equal(weight, moved)


def _trainer(out: Path, guard: NaNGuardCallback, max_steps: int = 5) -> tuple[Trainer, WeightsPerStep]:
    trainer = Trainer(model=tiny_llama(0), args=make_args(out, max_steps=max_steps), train_dataset=lm_dataset(10))
    sums = WeightsPerStep()
    for callback in (guard, sums):
        trainer.add_callback(callback)
    return trainer, sums


def test_skip_leaves_the_weights_of_that_step_and_goes_on(tmp_path: Path) -> None:
    """One weight's gradient is NaN at step 3; clipping (max_grad_norm=1) would spread it: the guard names that one."""
    guard = NaNGuardCallback("skip")
    trainer, sums = _trainer(tmp_path, guard)
    trainer.add_callback(NaNGradientAt(trainer, step=3))
    trainer.train()
    assert trainer.args.max_grad_norm == 1.0
    assert [(e.step, e.parameter, e.loss_non_finite) for e in guard.events] == [(3, NAN_PARAMETER, False)]
    assert sums.sums[3] == sums.sums[2] and sums.sums[4] != sums.sums[3] and sums.sums[5] != sums.sums[4]
    assert all(math.isfinite(s) for s in sums.sums)
    assert trainer.state.global_step == 5
    assert trainer.lr_scheduler.last_epoch == 4, "the skipped step does not advance the LR schedule"
    skipped = [entry.get("nan_guard_skipped_steps") for entry in trainer.state.log_history if "loss" in entry]
    assert skipped == [None, None, 1, 1, 1]


class NaNActivationAt(TrainerCallback):
    """Multiplies the token embeddings by NaN in the forward of step ``step``: the loss itself is NaN."""

    def __init__(self, trainer: Trainer, step: int) -> None:
        self.trainer, self.step, self._handle = trainer, step, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            embed = self.trainer.model.model.embed_tokens
            self._handle = embed.register_forward_hook(lambda module, args, out: out * float("nan"))

    def on_step_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def test_stop_ends_training_at_the_step_with_the_parameter_named(tmp_path: Path, caplog) -> None:
    guard = NaNGuardCallback("stop")
    trainer, sums = _trainer(tmp_path, guard)
    trainer.add_callback(NaNActivationAt(trainer, step=3))
    with caplog.at_level("ERROR", logger="trainer_ext.callbacks.nan_guard"):
        trainer.train()
    assert trainer.state.global_step == 3
    first = next(name for name, _ in trainer.model.named_parameters())
    assert [(e.step, e.parameter, e.loss_non_finite) for e in guard.events] == [(3, first, True)]
    assert sums.sums[3] == sums.sums[2] and all(math.isfinite(s) for s in sums.sums)
    assert f"step 3: a non-finite loss and a non-finite gradient, first in parameter {first}" in caplog.text


def test_an_unknown_action_is_refused() -> None:
    with pytest.raises(ValueError, match="'skip' or 'stop'"):
        NaNGuardCallback("ignore")
