"""Strategy registry: a name maps to one implementation; ``resolve_strategy`` picks the default."""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError, did_you_mean
from ..rules import check_world
from ..state import DistState
from .base import Strategy
from .ddp import DDPStrategy
from .deepspeed import DeepSpeedStrategy
from .fsdp import FSDPStrategy
from .single import SingleDeviceStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "deepspeed": DeepSpeedStrategy,
}


def resolve_strategy(state: DistState, name: str | None = None, **options: Any) -> Strategy:
    """Build the strategy ``name`` (default: ``ddp`` for several processes, else ``single``)."""
    if name is None:
        name = "ddp" if state.use_distributed else "single"
    if name not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}.{did_you_mean(name, STRATEGIES)}"
        )
    check_world(state.num_processes, name)
    cls = STRATEGIES[name]
    if cls is SingleDeviceStrategy:
        options = {}
    elif cls is DDPStrategy:
        options = {k: v for k, v in options.items() if k in DDPStrategy.option_names}
    return cls(state, **options)


__all__ = [
    "STRATEGIES",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "resolve_strategy",
]
