"""DistributedDataParallel: every rank holds the full model, gradients are all-reduced in backward."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from trainer_ext.distributed.strategies.base import Strategy


class DDPStrategy(Strategy):
    """Wraps the model in ``DistributedDataParallel``; ``no_sync`` skips the all-reduce.

    Options: ``dim``, ``find_unused_parameters``, ``bucket_cap_mb``, ``broadcast_buffers``, ``static_graph``,
    ``gradient_as_bucket_view`` (passed to DDP when set).
    """

    name = "ddp"
    title = "DDP"
    option_names = (
        "dim",
        "find_unused_parameters",
        "bucket_cap_mb",
        "broadcast_buffers",
        "static_graph",
        "gradient_as_bucket_view",
    )

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if isinstance(model, DistributedDataParallel):
            return model
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (e.g. evaluation only)
        kwargs = {k: v for k, v in self.options.items() if v is not None}
        if self.state.device.type == "cuda":
            kwargs["device_ids"] = [self.state.device.index]
            kwargs["output_device"] = self.state.device.index
        return DistributedDataParallel(model, **kwargs)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def after_failed_forward(self, model: torch.nn.Module) -> None:
        """DDP broadcasts buffers in the first forward after a synchronised one and clears its flag at the end of
        that forward; one that raised never got there, and the other ranks broadcast only once."""
        if isinstance(model, DistributedDataParallel):
            model.require_forward_param_sync = False
