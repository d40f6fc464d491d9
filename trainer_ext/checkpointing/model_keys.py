"""Matching a checkpoint to the prepared objects: model names it may lack (tied ones), the optimizer's model."""

from __future__ import annotations

from typing import Any

import torch

from trainer_ext.checkpointing.saving import tied_groups
from trainer_ext.errors import ConfigError


def check_loaded_keys(i: int, model: torch.nn.Module, missing: list[str], unexpected: list[str]) -> None:
    """ConfigError unless the only names missing from a checkpoint are tied ones (saved once)."""
    tied = {name for name in missing if _is_tied(model, name)}
    if set(missing) - tied or unexpected:
        raise ConfigError(
            f"model {i} does not match the checkpoint: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )


def optimizer_owner(optimizer: Any, models: list[torch.nn.Module]) -> torch.nn.Module:
    """The model whose parameters ``optimizer`` updates (its shards are keyed by that model's names)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in params for p in model.parameters()):
            return model
    raise ConfigError("an optimizer updates none of the prepared models' parameters; prepare its model too")


def _is_tied(model: torch.nn.Module, name: str) -> bool:
    """True when ``name`` holds the same tensor as another entry of the state dict (saved once)."""
    return any(name in names for names in tied_groups(model.state_dict()))
