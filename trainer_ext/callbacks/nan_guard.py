"""NaNGuardCallback: a non-finite loss or gradient skips the optimizer step, or stops training, and says where.

Why the checks sit where they do:

- gradients are checked as they are accumulated (a post-accumulate-grad hook per parameter), before clipping:
  ``clip_grad_norm_`` multiplies every gradient by ``max_norm / total_norm``, and a NaN norm turns *all* of them into
  NaN, which would hide the parameter where it started;
- the loss is checked in a forward hook on the model's output (``loss``), when the model computes it;
- the decision is taken in ``on_pre_optimizer_step`` from a flag reduced over ranks (the first bad parameter index,
  MIN), so every rank skips or stops together even when only one rank's batch went wrong;
- a skip does not call the optimizer at all: zeroing the gradients is not a skip (AdamW still moves the weights by
  its momentum and weight decay). The optimizer's ``step`` is replaced for that one call and reports a skipped step,
  so, as for an fp16 overflow, the LR schedule does not advance either;
- under fp16 the loss scaler owns gradient overflow (it skips the step and lowers the scale): gradients are then
  left to it and only the loss is checked.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from trainer_ext.callbacks._log_entry import add_to_log
from trainer_ext.distributed.optimizer import EngineOptimizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NonFiniteStep:
    """What was found at an optimizer step (numbered as ``state.global_step`` will be after it)."""

    step: int
    parameter: str | None  # the first parameter, in model order, whose gradient was non-finite
    loss_non_finite: bool

    def describe(self) -> str:
        what = " and ".join(
            (["a non-finite loss"] if self.loss_non_finite else [])
            + ([f"a non-finite gradient, first in parameter {self.parameter}"] if self.parameter else [])
        )
        return f"step {self.step}: {what}"


class NaNGuardCallback(TrainerCallback):
    """``action="skip"``: drop the step and go on; ``action="stop"``: drop the step and end training after it."""

    def __init__(self, action: str = "skip") -> None:
        if action not in ("skip", "stop"):
            raise ValueError(f"NaNGuardCallback action must be 'skip' or 'stop', got {action!r}")
        self.action = action
        self.events: list[NonFiniteStep] = []
        self._names: list[str] = []
        self._grad_bad: torch.Tensor | None = None
        self._loss_bad: torch.Tensor | None = None
        self._hooks: list[Any] = []

    # -- the checks, during the step --------------------------------------------------------------
    def _grad_hook(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if param.grad is not None:
                self._grad_bad[index] |= ~torch.isfinite(param.grad).all().to(self._grad_bad.device)

        return hook

    def _loss_hook(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not module.training:
            return
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if torch.is_tensor(loss):
            self._loss_bad |= ~torch.isfinite(loss.detach()).all().to(self._loss_bad.device)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._remove_hooks()
        if model is None:
            return
        device = args.device
        self._loss_bad = torch.zeros((), dtype=torch.bool, device=device)
        self._hooks.append(model.register_forward_hook(self._loss_hook))
        engine = getattr(optimizer, "engine", None)
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in params]
        self._grad_bad = torch.zeros(len(params), dtype=torch.bool, device=device)
        if engine is None or engine.scaler is None:
            for i, (_, p) in enumerate(params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(i)))

    def on_step_begin(self, args, state, control, **kwargs):
        if self._grad_bad is not None:
            self._grad_bad.zero_()
            self._loss_bad.zero_()

    # -- the decision, before the optimizer step ---------------------------------------------------
    def _first_problem(self) -> tuple[int, bool]:
        """(index of the first non-finite gradient or len(params), loss non-finite), agreed over all ranks."""
        count = len(self._names)
        positions = torch.arange(count, device=self._grad_bad.device)
        first = torch.where(self._grad_bad, positions, count).min() if count else torch.tensor(0)
        packed = torch.stack([first.to(self._loss_bad.device), -self._loss_bad.long()])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.MIN)
        index, loss_flag = packed.tolist()
        return index, loss_flag < 0

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self._grad_bad is None:
            return
        index, loss_bad = self._first_problem()
        if index == len(self._names) and not loss_bad:
            return
        event = NonFiniteStep(
            state.global_step + 1, self._names[index] if index < len(self._names) else None, loss_bad
        )
        self.events.append(event)
        if optimizer is not None:
            _skip_next_step(optimizer)
        if self.action == "stop":
            control.should_training_stop = True
            logger.error("NaNGuard: %s; the step is not applied and training stops", event.describe())
        else:
            logger.warning("NaNGuard: %s; the optimizer step is skipped", event.describe())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs and self.events:
            add_to_log(state, logs, {"nan_guard_skipped_steps": len(self.events)})

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _skip_next_step(optimizer: torch.optim.Optimizer) -> None:
    """Make the next ``optimizer.step()`` a reported no-op, then put the real one back.

    The instance may already carry a ``step`` of its own (LR schedulers wrap it to check the call order): that one is
    restored, not the class's.
    """
    previous = optimizer.__dict__.get("step")

    def skipped_step(closure: Any = None) -> None:
        if previous is None:
            del optimizer.step
        else:
            optimizer.step = previous
        if isinstance(optimizer, EngineOptimizer):
            optimizer.engine.step_was_skipped = True  # the Trainer then leaves the LR scheduler alone

    optimizer.step = skipped_step
