"""trainer_ext.distributed — the distributed-state module that replaces accelerate for the Trainer and loops."""

from .accumulation import GradientState
from .data import BatchSamplerShard, SeedableRandomSampler, ShardedDataLoader, skip_first_batches
from .engine import Engine
from .optimizer import EngineOptimizer
from .precision import Precision
from .state import DistributedType, DistState, Topology, detect_topology
from .strategies import STRATEGIES, Strategy, resolve_strategy

__all__ = [
    "STRATEGIES",
    "BatchSamplerShard",
    "DistState",
    "DistributedType",
    "Engine",
    "EngineOptimizer",
    "GradientState",
    "Precision",
    "SeedableRandomSampler",
    "ShardedDataLoader",
    "Strategy",
    "Topology",
    "detect_topology",
    "resolve_strategy",
    "skip_first_batches",
]
