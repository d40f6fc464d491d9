"""The ``Accelerator`` is one class holding helpers (engine, checkpoints, trackers), not a stack of partial mixins,
and a user's subclass takes part where accelerate's own methods call another public one: an override of
``wait_for_everyone``, ``free_memory``, ``reduce``, ``no_sync``, ``unscale_gradients`` or ``unwrap_model`` is what
``save_state``/``save_model``, ``clear``, ``check_trigger``, ``accumulate``, ``clip_grad_value_`` and ``profile`` run.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from trainer_ext import Accelerator, ProfileKwargs, ProjectConfiguration


class Recording(Accelerator):
    """An Accelerator whose overrides note each call, then do what the base class does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def wait_for_everyone(self) -> None:
        self.calls.append("wait_for_everyone")
        super().wait_for_everyone()

    def free_memory(self, *objects: Any) -> tuple[Any, ...]:
        self.calls.append("free_memory")
        return super().free_memory(*objects)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        self.calls.append("reduce")
        return super().reduce(tensor, reduction, scale)

    def no_sync(self, model: torch.nn.Module) -> Any:
        self.calls.append("no_sync")
        return super().no_sync(model)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        self.calls.append("unscale_gradients")
        super().unscale_gradients(optimizer)

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        self.calls.append("unwrap_model")
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)


def _model_and_optimizer(accelerator: Accelerator) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_accelerator_is_one_class_without_mixins() -> None:
    assert Accelerator.__mro__ == (Accelerator, object)
    import trainer_ext.accelerator.checkpoints as checkpoints

    # the checkpoint helper raises no NotImplementedError stub that only the host's MRO replaces
    assert "NotImplementedError" not in inspect.getsource(checkpoints)


def test_save_state_and_save_model_run_the_subclass_barrier_and_unwrap(tmp_path: Path) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Recording(cpu=True, project_config=config)
    model, _ = _model_and_optimizer(accelerator)
    accelerator.save_state()
    assert accelerator.calls.count("wait_for_everyone") >= 2  # around the numbered folder, as accelerate's
    assert "unwrap_model" in accelerator.calls
    accelerator.calls.clear()
    accelerator.save_model(model, tmp_path / "model")
    assert accelerator.calls == ["unwrap_model", "wait_for_everyone"]
    assert isinstance(accelerator, Accelerator)


def test_clear_runs_the_subclass_free_memory() -> None:
    accelerator = Recording(cpu=True)
    assert accelerator.clear(torch.nn.Linear(2, 1)) == (None,)
    assert accelerator.calls == ["free_memory"]


def test_check_trigger_reduces_through_the_subclass() -> None:
    accelerator = Recording(cpu=True)
    accelerator.set_trigger()
    assert accelerator.check_trigger()
    assert not accelerator.check_trigger()
    assert accelerator.calls == ["reduce", "reduce"]


def test_accumulate_and_clip_grad_value_run_the_subclass_methods() -> None:
    accelerator = Recording(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = _model_and_optimizer(accelerator)
    with accelerator.accumulate(model):  # the first of two micro-batches: no sync
        accelerator.backward(model(torch.ones(1, 2)).sum())
    assert accelerator.calls == ["no_sync"]
    accelerator.clip_grad_value_(model.parameters(), 0.1)
    assert accelerator.calls == ["no_sync", "unscale_gradients"]
    assert all(p.grad.abs().max() <= 0.1 for p in model.parameters())


def test_profile_with_a_trace_folder_waits_through_the_subclass(tmp_path: Path) -> None:
    accelerator = Recording(cpu=True)
    with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))):
        torch.ones(2).sum()
    assert accelerator.calls == ["wait_for_everyone"]
    assert list(tmp_path.iterdir())
