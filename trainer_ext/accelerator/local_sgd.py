"""``LocalSGD``: accelerate's ``accelerate.local_sgd.LocalSGD`` on our ``Accelerator``.

Inside the block each process steps its optimizer on its own gradients (DDP's gradient all-reduce is off), and
every ``local_sgd_steps`` calls of ``step()``, and once more on leaving the block, the processes average their
weights: one all-reduce per parameter every K steps instead of one per step.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_ext.distributed.state import DistributedType

# the engines whose prepared model is a plain (DDP-wrapped or unwrapped) module with every parameter whole
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class LocalSGD:
    """``with LocalSGD(accelerator=..., model=..., local_sgd_steps=K) as local_sgd:`` around the loop, and
    ``local_sgd.step()`` after each optimizer step. Off on one process (nothing to average) or with
    ``enabled=False``; refused under FSDP and DeepSpeed, whose parameters are sharded."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        kind = accelerator.distributed_type
        if kind not in _SUPPORTED:
            raise NotImplementedError(
                "LocalSGD is supported only for CPUs and GPUs (no DeepSpeed or MegatronLM): this Accelerator runs "
                f"{kind.value}, whose parameters are sharded; use DDP (no fsdp_config/deepspeed_config) for LocalSGD"
            )
        self.enabled = enabled and kind != DistributedType.NO
        self.num_steps = 0
        if self.enabled:
            self.accelerator = accelerator
            self.model = model
            self.local_sgd_steps = local_sgd_steps

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.model.no_sync()
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.enabled:
            self._average()  # the block ends with the processes' weights equal
            self._no_sync.__exit__(exc_type, exc, tb)

    def step(self) -> None:
        """Count an optimizer step; every ``local_sgd_steps``-th averages the weights across processes."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    def _average(self) -> None:
        """Every parameter replaced by its mean over the processes (in place: optimizers keep their tensors)."""
        self.accelerator.wait_for_everyone()
        with self.accelerator.autocast():
            for param in self.model.parameters():
                param.data.copy_(self.accelerator.reduce(param.data, reduction="mean"))
