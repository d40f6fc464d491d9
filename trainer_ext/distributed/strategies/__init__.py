"""Strategy registry: a name maps to one implementation; ``resolve_strategy`` picks the default."""

from __future__ import annotations

import os
from typing import Any

from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.distributed.state import DistState
from trainer_ext.distributed.strategies.base import Strategy
from trainer_ext.distributed.strategies.ddp import DDPStrategy
from trainer_ext.distributed.strategies.deepspeed.strategy import DeepSpeedStrategy
from trainer_ext.distributed.strategies.fsdp.strategy import FSDPStrategy
from trainer_ext.distributed.strategies.pipeline import PipelineStrategy
from trainer_ext.distributed.strategies.single import SingleDeviceStrategy
from trainer_ext.errors import ConfigError, did_you_mean

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "deepspeed": DeepSpeedStrategy,
    "pipeline": PipelineStrategy,
}


def strategy_for(name: str | None, parallelism: ParallelismConfig | None, world_size: int) -> type[Strategy]:
    """The strategy class ``name`` names (default: ``fsdp`` when ``parallelism`` splits the model over a mesh, else
    ``ddp`` for several processes, else ``single``; ``pipeline`` when it has ``pp_size > 1``, FSDP's settings kept),
    checked to take ``parallelism``'s layout (no group needed)."""
    if parallelism is not None and parallelism.pp_enabled and name in (None, "fsdp"):
        name = "pipeline"
    if name is None:
        if parallelism is not None and parallelism.splits_model:
            name = "fsdp"
        else:
            name = "ddp" if world_size > 1 else "single"
    if name not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}.{did_you_mean(name, STRATEGIES)}"
        )
    if parallelism is not None:
        STRATEGIES[name].check_parallelism(parallelism)
    return STRATEGIES[name]


def resolve_strategy(
    state: DistState, name: str | None = None, *, parallelism: ParallelismConfig | None = None, **options: Any
) -> Strategy:
    """Build the strategy ``name`` (see :func:`strategy_for`) on ``state``'s processes."""
    cls = strategy_for(name, parallelism, state.num_processes if state.use_distributed else 1)
    cls.claim_world(state)
    return cls.from_options(state, **options)
    return STRATEGIES[name].from_options(state, **options)


def checkpoint_owner(directory: str | os.PathLike) -> type[Strategy] | None:
    """The strategy whose own checkpoint format ``directory`` holds (only it can resume it), or None."""
    return next((cls for cls in STRATEGIES.values() if cls.has_own_checkpoint(directory)), None)


__all__ = [
    "STRATEGIES",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "PipelineStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "checkpoint_owner",
    "resolve_strategy",
    "strategy_for",
]
