"""The one place that says which combinations of device, precision and strategy are allowed.

Each rule raises :class:`~trainer_ext.errors.ConfigError` with what is wrong and how to fix it.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def check_precision(mixed_precision: str, device: torch.device, *, fp16: bool = False, bf16: bool = False) -> None:
    """fp16 needs CUDA; bf16 needs a GPU that has it; fp16 and bf16 exclude each other."""
    if fp16 and bf16:
        raise ConfigError("both --fp16 and --bf16 were given; choose one (bf16 is the safer choice where supported)")
    if mixed_precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            f"fp16 mixed precision needs a CUDA GPU, but this process runs on {device.type}. "
            "Drop --fp16, or use --bf16 (supported on CPU)."
        )
    if mixed_precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"bf16 is not supported by {torch.cuda.get_device_name(device)} (it needs compute capability >= 8.0). "
            "Use --fp16 instead."
        )


def check_world(world_size: int, strategy: str) -> None:
    """A single-device strategy cannot run on several processes."""
    if strategy == "single" and world_size > 1:
        raise ConfigError(f"strategy 'single' cannot run on {world_size} processes; use 'ddp' or launch one process")
