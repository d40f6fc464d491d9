"""How a job's ``parallelism_config`` reaches the engine: ours, accelerate's object or a dict taken as ours, the
launch's ``PARALLELISM_CONFIG_*`` variables when none is passed, and the rules checked before any group work."""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.distributed.mesh.device_mesh import fit_to_world
from trainer_ext.env_vars import USE_PARALLELISM_CONFIG
from trainer_ext.errors import ConfigError
from trainer_ext.values import parse_bool

_FIELDS = tuple(item.name for item in fields(ParallelismConfig))


def launched() -> bool:
    """True when the launcher (ours, or ``accelerate launch``) asked for a parallelism config by its variables."""
    value = os.environ.get(USE_PARALLELISM_CONFIG, "")
    return bool(value) and parse_bool(value, USE_PARALLELISM_CONFIG)


def as_parallelism_config(value: Any, *, from_launch: bool = True) -> ParallelismConfig | None:
    """``value`` as our ``ParallelismConfig``: ours as it is, accelerate's (or any object with its fields) and a dict
    rebuilt from their fields; None becomes the launch's configuration when ``from_launch`` and one was exported."""
    if value is None:
        return ParallelismConfig() if from_launch and launched() else None
    if isinstance(value, ParallelismConfig):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ConfigError(f"parallelism_config has no field {unknown[0]!r}: its fields are {', '.join(_FIELDS)}")
        return ParallelismConfig(**value)
    if all(hasattr(value, name) for name in ("tp_size", "dp_shard_size", "dp_replicate_size")):
        taken = {name: getattr(value, name) for name in _FIELDS if hasattr(value, name)}
        if taken.get("cp_backend") == "torch":
            taken["cp_backend"] = "auto"  # accelerate's only choice, not a choice: ours picks torch on CUDA too
        return ParallelismConfig(**taken)
    raise ConfigError(
        f"parallelism_config must be a ParallelismConfig (trainer_ext's or accelerate's) or a dict of its sizes, "
        f"got {type(value).__name__}"
    )


def check_parallelism(config: ParallelismConfig | None, world_size: int, cpu: bool = False) -> None:
    """The sizes against the job's processes (accelerate's rule: all sizes 1 on several processes replicates), and a
    context-parallel backend against the device the job will run on (CUDA unless ``cpu`` or none is present)."""
    if config is not None:
        fit_to_world(config, world_size)
        if config.cp_enabled:
            import torch

            from trainer_ext.distributed.mesh.context_parallel import resolve_backend

            resolve_backend(config.cp_backend, "cpu" if cpu or not torch.cuda.is_available() else "cuda")


def shards_by_mesh(config: ParallelismConfig | None) -> bool:
    """True when the configuration splits the model or its sequences (data sharding, tensor or context parallelism),
    not only the data."""
    return config is not None and config.splits_model


def describe(config: ParallelismConfig) -> str:
    """The mesh in one phrase, e.g. ``dp_shard 2 x tp 2`` (``one process`` when no dimension is enabled)."""
    dims = config._get_mesh()
    if not dims:
        return "one process"
    return " x ".join(f"{name} {size}" for name, size in zip(*dims, strict=True))
