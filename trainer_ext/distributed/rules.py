"""The one place that says which combinations of device, precision and strategy are allowed.

Each rule raises :class:`~trainer_ext.errors.ConfigError` with what is wrong and how to fix it.
"""

from __future__ import annotations

import importlib.util

import torch

from trainer_ext.distributed.state import DistState
from trainer_ext.distributed.strategies import STRATEGIES  # the registry: strategies never import this module
from trainer_ext.errors import ConfigError


def check_precision(mixed_precision: str, device: torch.device, *, fp16: bool = False, bf16: bool = False) -> None:
    """fp16 needs CUDA; bf16 needs a GPU that has it; fp16 and bf16 exclude each other."""
    if fp16 and bf16:
        raise ConfigError("both --fp16 and --bf16 were given; choose one (bf16 is the safer choice where supported)")
    if mixed_precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            f"fp16 mixed precision needs a CUDA GPU, but this process runs on {device.type}. "
            "Drop --fp16, or use --bf16 (supported on CPU)."
        )
    if mixed_precision == "fp8":
        check_fp8(device)
    if mixed_precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"bf16 is not supported by {torch.cuda.get_device_name(device)} (it needs compute capability >= 8.0). "
            "Use --fp16 instead."
        )


def check_fp8(device: torch.device) -> None:
    """fp8 needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or newer) and torchao."""
    if device.type != "cuda":
        raise ConfigError(
            f"fp8 training needs a CUDA GPU with compute capability >= 8.9, but this process runs on "
            f"{device.type}. Use --bf16 instead."
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ConfigError(
            f"fp8 training needs compute capability >= 8.9 (H100, L4, RTX 4090 …); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}. Use --bf16 instead."
        )
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("fp8 training uses torchao, which is not installed: pip install 'torchao>=0.10'")


def check_world(world_size: int, strategy: str) -> None:
    """The strategy named ``strategy`` runs on ``world_size`` processes (its class says how many it takes)."""
    found = STRATEGIES.get(strategy)
    if found is not None:
        found.check_world(world_size)


def claim_world(state: DistState, strategy: str) -> None:
    """``check_world`` for ``state``'s processes, then the process group the strategy needs (one of one process)."""
    found = STRATEGIES.get(strategy)
    if found is not None:
        found.claim_world(state)
