"""The strategy owns its precision, how models and optimizers are set up, and the step: the engine calls its hooks.

A strategy written here (one process, no backend) takes each hook over, as DeepSpeed's does, and the engine and
its optimizer follow it without asking which strategy it is.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_ext.distributed import DistState, Engine, EngineOptimizer
from trainer_ext.distributed.precision import Precision
from trainer_ext.distributed.strategies import SingleDeviceStrategy


def _model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 1)


class SteppingInBackward(SingleDeviceStrategy):
    """Backward steps the optimizer itself at the boundary (reporting the second step as skipped)."""

    def __init__(self, state: DistState, **options: Any) -> None:
        super().__init__(state, **options)
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps = 0

    def backward(self, loss: torch.Tensor, *, sync: bool | None = None, **kwargs: Any) -> bool | None:
        loss.backward(**kwargs)
        if not sync:
            return None
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1
        return self.steps == 2

    def should_step(self, sync: bool) -> bool:
        return False


def test_a_strategy_may_take_backward_and_the_step_over() -> None:
    strategy = SteppingInBackward(DistState(init=False))
    engine = Engine(strategy.state, strategy=strategy)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, prepared = engine.prepare(model, optimizer)
    strategy.optimizer = optimizer
    x = torch.ones(2, 3)
    before = model.weight.detach().clone()

    engine.gradient_state.sync_gradients = False
    engine.backward(model(x).sum())
    prepared.step()  # the strategy says no: nothing happens here
    prepared.zero_grad()
    assert torch.equal(model.weight, before) and model.weight.grad is not None
    assert (engine.skipped_steps, engine.step_was_skipped) == (0, False)

    engine.gradient_state.sync_gradients = True
    engine.backward(model(x).sum())  # the boundary: the strategy stepped inside backward
    assert not torch.equal(model.weight, before) and model.weight.grad is None
    prepared.step()
    assert strategy.steps == 1 and engine.step_was_skipped is False
    engine.backward(model(x).sum())
    assert strategy.steps == 2 and engine.step_was_skipped is True and engine.skipped_steps == 1


class SettingUpTogether(SingleDeviceStrategy):
    """Sets a model and its optimizer up together (a container and a new optimizer), and evaluation models alone."""

    def setup_module_and_optimizer(self, model: Any, optimizer: Any, training_steps: Any) -> tuple[Any, Any]:
        self.training_steps = training_steps
        return torch.nn.Sequential(model), torch.optim.SGD(model.parameters(), lr=0.25)

    def setup_module_alone(self, model: Any, *, evaluation: bool, device: Any) -> Any:
        return torch.nn.ModuleList([model]) if evaluation else None

    def is_prepared(self, model: Any) -> bool:
        return isinstance(model, torch.nn.Sequential | torch.nn.ModuleList)


def test_a_strategy_may_set_models_and_optimizers_up_together() -> None:
    strategy = SettingUpTogether(DistState(init=False))
    engine = Engine(strategy.state, strategy=strategy)
    engine.training_steps = (10, 2)
    model = _model()
    wrapped, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(wrapped, torch.nn.Sequential) and wrapped[0] is model
    assert isinstance(optimizer, EngineOptimizer) and optimizer.optimizer.defaults["lr"] == 0.25
    assert strategy.training_steps == (10, 2)
    assert engine.prepared_models == [wrapped] and engine.prepared_optimizers == [optimizer]

    evaluated = engine.prepare_model(_model(1), evaluation_mode=True)
    assert isinstance(evaluated, torch.nn.ModuleList)
    trained = _model(2)
    assert engine.prepare_model(trained) is trained  # None from the strategy: the engine's own preparation


class HalfPrecisionItself(SingleDeviceStrategy):
    """Casts by itself: a precision that does nothing, whatever the mode asked for."""

    def setup_precision(self, mode: str, **kwargs: Any) -> Precision:
        self.asked = mode
        self.precision = Precision("no", self.state.device)
        return self.precision


def test_the_precision_is_the_strategys() -> None:
    plain = Engine(DistState(init=False), mixed_precision="bf16")
    assert plain.precision is plain.strategy.precision and plain.precision.mode == "bf16"

    strategy = HalfPrecisionItself(DistState(init=False))
    engine = Engine(strategy.state, strategy=strategy, mixed_precision="bf16")
    assert strategy.asked == "bf16" and engine.mixed_precision == "bf16"
    assert engine.precision is strategy.precision and engine.precision.dtype is None
    model = engine.prepare(_model())
    assert "_original_forward" not in model.__dict__  # no autocast patch of the engine's on top


def test_the_precision_removes_its_forward_patch() -> None:
    model = _model()
    Precision("bf16", torch.device("cpu")).patch_forward(model)
    assert model(torch.ones(1, 3)).dtype == torch.float32 and "_original_forward" in model.__dict__
    assert Precision.restore_forward(model) is model
    assert "_original_forward" not in model.__dict__ and "_trainer_ext_autocast" not in model.__dict__
    assert model.forward.__func__ is torch.nn.Linear.forward
    Precision.restore_forward(model)  # unpatched: nothing to do
    Precision("bf16", torch.device("cpu")).patch_forward(model)  # and it patches again
    assert model.__dict__["_trainer_ext_autocast"] == "bf16"
