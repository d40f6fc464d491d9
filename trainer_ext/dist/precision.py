"""Mixed precision, independent of the strategy: autocast around ``forward`` and the fp16 GradScaler.

transformers' Trainer adds no autocast of its own without accelerate, so ``prepare`` patches the model's
``forward``: outputs come back in fp32, the original stays reachable as ``model._original_forward``.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch

from .collectives import recursively_apply

MIXED_PRECISION = ("no", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _to_fp32(data: Any) -> Any:
    def _cast(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t

    if hasattr(data, "to_tuple") and hasattr(data, "keys"):  # transformers ModelOutput: keep its class
        for key in list(data.keys()):
            data[key] = recursively_apply(_cast, data[key])
        return data
    return recursively_apply(_cast, data)


class Precision:
    """One precision mode on one device: ``autocast()``, ``patch_forward(model)`` and the scaler."""

    def __init__(
        self,
        mode: str,
        device: torch.device,
        *,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        uses_scaler: bool = True,
    ) -> None:
        if mode not in MIXED_PRECISION:
            raise ValueError(f"mixed precision must be one of {MIXED_PRECISION}, not {mode!r}")
        self.mode = mode
        self.device = device
        self.dtype = _DTYPES.get(mode)
        self.scaler: torch.amp.GradScaler | None = None
        if mode == "fp16" and uses_scaler and device.type != "cpu":
            self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context for this mode (a null context for full precision)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def patch_forward(self, model: torch.nn.Module) -> torch.nn.Module:
        """Run ``model.forward`` under autocast with fp32 outputs; idempotent, survives ``deepcopy``."""
        if self.dtype is None or getattr(model, "_trainer_ext_autocast", None) == self.mode:
            return model
        # Start from the unpatched forward (also when re-patching for another mode), and bind the
        # wrapper as a method so that a deep copy of the model runs its own weights, not ours.
        original = model.__dict__.get("_original_forward") or model.forward
        func = original.__func__ if getattr(original, "__self__", None) is model else None
        if "_original_forward" not in model.__dict__:
            model._original_forward = original
        autocast = self.autocast

        @functools.wraps(func or original)
        def forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            with autocast():
                out = func(module, *args, **kwargs) if func is not None else original(*args, **kwargs)
            return _to_fp32(out)

        model.forward = types.MethodType(forward, model)
        model._trainer_ext_autocast = self.mode
        return model

    # -- GradScaler (fp16 on an accelerator only) -----------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` (through the scaler); return True if the step was skipped (inf/NaN grads)."""
        if self.scaler is None:
            optimizer.step()
            return False
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() < before
