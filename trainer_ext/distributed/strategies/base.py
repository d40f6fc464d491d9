"""The strategy interface: how a model is wrapped, synchronised and unwrapped for one backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from ..state import DistributedType, DistState


class Strategy:
    """Base strategy: one process, nothing wrapped. Subclasses override what their backend changes.

    Capability flags let callers ask what a backend owns instead of asking which backend it is.
    """

    name = "single"
    owns_loss_scaling = False  # the backend scales fp16 losses itself (DeepSpeed)
    owns_accumulation = False  # the backend decides accumulation boundaries itself (DeepSpeed)
    sharded_checkpoints = False  # no rank holds the whole model: checkpoints are written by every rank (FSDP)
    owns_mixed_precision = False  # the backend casts the model and runs the step in its dtype (DeepSpeed)
    joint_prepare = False  # model and optimizer are wrapped together (DeepSpeed's engine)

    def __init__(self, state: DistState, **options: Any) -> None:
        self.state = state
        self.options = options

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap a model already on its device for training; the base strategy returns it as is."""
        return model

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point an optimizer built before :meth:`wrap` at the parameters the wrapper trains (no-op here)."""

    def forget(self) -> None:
        """Drop what was remembered about prepared models (the engine's ``free_memory``)."""

    def make_grad_scaler(self, device_type: str, **kwargs: Any) -> torch.amp.GradScaler:
        """The fp16 loss scaler for this backend."""
        return torch.amp.GradScaler(device_type, **kwargs)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Strip this strategy's wrapper (and DataParallel) to reach the user's module."""
        while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        return model

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context in which backward does not synchronise gradients (non-final micro-batches)."""
        return contextlib.nullcontext()

    def after_failed_forward(self, model: torch.nn.Module) -> None:
        """Undo what a forward that raised (out of memory) left half done, so that the retry issues the same
        collectives as the ranks that did not fail. Nothing to undo by default."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    def backward_and_step(self, loss: torch.Tensor, boundary: bool) -> bool:
        """Backends that own accumulation (``owns_accumulation``): backward, then step at ``boundary``;
        returns True when the step was skipped (fp16 overflow)."""
        raise NotImplementedError(f"strategy {self.name!r} leaves the optimizer step to the caller")

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
