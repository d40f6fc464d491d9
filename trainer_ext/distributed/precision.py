"""Mixed precision, independent of the strategy: autocast around ``forward``, the fp16 GradScaler, fp8.

transformers' Trainer adds no autocast of its own without accelerate, so ``prepare`` patches the model's
``forward``: outputs come back in fp32, the original stays reachable as ``model._original_forward``, and
:meth:`Precision.restore_forward` puts it back. A strategy builds and holds the ``Precision`` it trains with.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from typing import Any

import torch

from trainer_ext.distributed.collectives import recursively_apply
from trainer_ext.values import MIXED_PRECISION

# fp8 runs its Linear layers in float8 (torchao) and everything else under bf16 autocast
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}

logger = logging.getLogger(__name__)


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
        scaler_factory: Any = None,
        autocast_kwargs: dict[str, Any] | None = None,
        **scaler_kwargs: Any,
    ) -> None:
        """``scaler_kwargs`` go to the fp16 ``GradScaler`` (``init_scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``enabled``); ``autocast_kwargs`` to ``torch.autocast`` (``enabled``, ``cache_enabled``)."""
        if mode not in MIXED_PRECISION:
            raise ValueError(f"mixed precision must be one of {MIXED_PRECISION}, not {mode!r}")
        self.mode = mode
        self.device = device
        self.dtype = _DTYPES.get(mode)
        self.scaler: torch.amp.GradScaler | None = None
        if mode == "fp16" and device.type != "cpu":
            factory = scaler_factory or torch.amp.GradScaler
            self.scaler = factory(device.type, **{"init_scale": 2.0**16, "growth_interval": 2000, **scaler_kwargs})
        self.autocast_kwargs = dict(autocast_kwargs or {})

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def autocast(self, **overrides: Any) -> contextlib.AbstractContextManager[Any]:
        """The autocast context for this mode (a null context for full precision); ``overrides`` replace the
        ``autocast_kwargs`` given at construction for this block."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype, **{**self.autocast_kwargs, **overrides})

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

    @staticmethod
    def restore_forward(model: torch.nn.Module) -> torch.nn.Module:
        """Undo :meth:`patch_forward` (of any mode): the model's own ``forward`` again; a no-op when unpatched."""
        if "_original_forward" in model.__dict__:
            model.forward = model.__dict__.pop("_original_forward")
            model.__dict__.pop("_trainer_ext_autocast", None)
        return model

    def prepare_for_training(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make trainable weights fit the mode: fp32 masters under fp16 AMP; float8 Linear layers for fp8."""
        if self.scaler is not None:
            upcast_half_trainable(model)
        if self.mode == "fp8" and not getattr(model, "_trainer_ext_fp8", False):
            convert_to_float8(model)
            model._trainer_ext_fp8 = True
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


def upcast_half_trainable(model: torch.nn.Module) -> list[str]:
    """Upcast fp16 trainable parameters to fp32 (in place, same Parameter objects) and warn.

    fp16 AMP needs fp32 master weights: the GradScaler refuses to unscale fp16 gradients ("Attempting to
    unscale FP16 gradients"). Frozen fp16 weights stay as they are, so adapters on a half base still fit.
    """
    names = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
    if not names:
        return names
    for param in model.parameters():
        if param.requires_grad and param.dtype == torch.float16:
            param.data = param.data.float()
    logger.warning(
        "fp16 mixed precision needs fp32 trainable weights; upcast %d fp16 trainable parameters (e.g. %s) "
        "to fp32. Load the model in float32 (the default torch_dtype) to avoid the extra copy.",
        len(names),
        names[0],
    )
    return names


def _float8_eligible(module: torch.nn.Module, fqn: str) -> bool:
    # float8 matmuls need both dimensions divisible by 16; the output head stays in bf16 for accuracy
    if not isinstance(module, torch.nn.Linear):
        return False
    if fqn.split(".")[-1] in ("lm_head", "score", "classifier"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8(model: torch.nn.Module) -> torch.nn.Module:
    """Swap eligible Linear layers for torchao's float8 training layers (dynamic tensorwise scaling)."""
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model, module_filter_fn=_float8_eligible)
