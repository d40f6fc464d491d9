"""Per-step work of transformers' loop whose answer does not change between steps, done once instead.

transformers' ``training_step`` calls ``model.train()`` (a Python walk over every module) and the loop counts
``floating_point_ops`` (a walk over every parameter) at every step. Both grow with the model and give the same
answer each time; this mixin gives the same answers from a cache, so the per-step Python work stays flat.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel

# ``train`` methods that only walk the modules when no mode changes (DDP's and transformers' add nothing then):
# skipping ``train(True)`` on a model whose every module is training changes nothing
_PLAIN_TRAIN = (torch.nn.Module.train, DistributedDataParallel.train, PreTrainedModel.train)


class _TrainingModes:
    """The modules of one model, to ask cheaply whether every one of them is already in training mode.

    Listed once per model: a module attached to the model during training is not looked at.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.modules = list(model.modules())

    def all_training(self) -> bool:
        return all(module.training for module in self.modules)


class LeanStepMixin:
    """Mix in before ``transformers.Trainer``: ``model.train()`` only when a module is not training, and the
    parameter count of ``floating_point_ops`` computed once per model."""

    _lean_modes: _TrainingModes | None = None
    _lean_num_parameters: tuple[Any, int] | None = None

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """transformers' step, with its ``model.train()`` a no-op when every module is already training."""
        if type(model).train not in _PLAIN_TRAIN or "train" in model.__dict__:
            return super().training_step(model, inputs, *args, **kwargs)
        if self._lean_modes is None or self._lean_modes.model is not model:
            self._lean_modes = _TrainingModes(model)
        model.train = _lean_train(self._lean_modes)  # shadows the method for transformers' one call, then goes
        try:
            return super().training_step(model, inputs, *args, **kwargs)
        finally:
            model.__dict__.pop("train", None)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """transformers' estimate (6 × tokens × non-embedding parameters), counting the parameters once."""
        model = self.model
        main_input = getattr(model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(model, "num_parameters"):
            return super().floating_point_ops(inputs)
        cached = self._lean_num_parameters
        if cached is None or cached[0] is not model:
            cached = self._lean_num_parameters = (model, model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main_input].numel() * cached[1]


def _lean_train(modes: _TrainingModes) -> Any:
    """A one-call ``model.train``: ``train()`` with every module already training returns at once; anything else
    runs the real method. The first call removes it, so later calls reach the real method directly."""
    model = modes.model
    method = type(model).train

    def train(mode: bool = True) -> torch.nn.Module:
        model.__dict__.pop("train", None)
        return model if mode and modes.all_training() else method(model, mode)

    return train
