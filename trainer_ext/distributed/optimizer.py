"""The optimizer wrapper: steps only at sync boundaries and through the fp16 scaler.

It is a real ``torch.optim.Optimizer`` (LR schedulers insist) that forwards everything to the user's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer_ext.distributed.engine import Engine


class OptimizerPlaceholder:
    """Stands for an optimizer the strategy's backend builds from its own config (accelerate's ``DummyOptim``):
    ``prepare`` hands it to the strategy with its model and returns the optimizer built in its place."""


class EngineOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer for an :class:`Engine`; ``optimizer`` is the original."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: Engine) -> None:
        # No super().__init__: the state lives in the wrapped optimizer, which we forward to.
        self.optimizer = optimizer
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients at a sync boundary only, so accumulating loops keep every micro-batch's."""
        if self.engine.strategy.owns_accumulation:
            return  # DeepSpeed zeroes them in its own step
        if self.engine.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        """Step at a sync boundary (through the scaler for fp16); a no-op on other micro-batches.

        Under DeepSpeed the engine already stepped in ``backward`` (at the boundary): nothing left to do.
        """
        if not self.engine.gradient_state.sync_gradients or self.engine.strategy.owns_accumulation:
            return
        if closure is not None:
            self.optimizer.step(closure)
            self.engine.step_was_skipped = False
            return
        skipped = self.engine.precision.step(self.optimizer)
        self.engine.step_was_skipped = skipped
        self.engine.skipped_steps += int(skipped)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def train(self) -> None:
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    @property
    def step_was_skipped(self) -> bool:
        return self.engine.step_was_skipped

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.optimizer!r})"
