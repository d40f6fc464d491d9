"""trainer_ext.distributed — the distributed-state module that replaces accelerate for the Trainer and loops.

Names load lazily, so a light submodule (``cpu_threads``, read by the CLI before torch) imports without the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GradientState": "trainer_ext.distributed.accumulation",
    "BatchSamplerShard": "trainer_ext.distributed.data.loader",
    "SeedableRandomSampler": "trainer_ext.distributed.data.loader",
    "ShardedDataLoader": "trainer_ext.distributed.data.loader",
    "skip_first_batches": "trainer_ext.distributed.data.loader",
    "Engine": "trainer_ext.distributed.engine",
    "EngineOptimizer": "trainer_ext.distributed.optimizer",
    "Precision": "trainer_ext.distributed.precision",
    "DistributedType": "trainer_ext.distributed.state",
    "DistState": "trainer_ext.distributed.state",
    "Topology": "trainer_ext.distributed.state",
    "detect_topology": "trainer_ext.distributed.state",
    "STRATEGIES": "trainer_ext.distributed.strategies",
    "Strategy": "trainer_ext.distributed.strategies",
    "resolve_strategy": "trainer_ext.distributed.strategies",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_ext.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
