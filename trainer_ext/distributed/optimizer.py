"""The optimizer wrapper: steps when the strategy says so (sync boundaries), the way the strategy steps.

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


class SchedulerPlaceholder:
    """Stands for an LR scheduler the strategy's backend builds and steps itself (accelerate's ``DummyScheduler``)."""


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
        """Clear gradients when the strategy steps (a sync boundary), so accumulating loops keep every micro-batch's."""
        strategy = self.engine.strategy
        if strategy.should_step(self.engine.gradient_state.sync_gradients):
            strategy.zero_grad(self.optimizer, set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        """The strategy's optimizer step (through the fp16 scaler) when it steps now; a no-op on other micro-batches
        and for a strategy that stepped in ``backward`` already."""
        strategy = self.engine.strategy
        if strategy.should_step(self.engine.gradient_state.sync_gradients):
            self.engine.record_step(strategy.optimizer_step(self.optimizer, closure))

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
