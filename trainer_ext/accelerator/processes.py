"""What the ``Accelerator``'s process coordination needs beyond the engine, with accelerate's meaning.

Decorators that run a function on some processes only, ``join_uneven_inputs`` (torch's ``Join``) for data that
does not divide evenly, and accelerate's answers for parallel dimensions that are not configured.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.algorithms.join import Join, Joinable

from trainer_ext.distributed.data.loader import BatchSamplerShard
from trainer_ext.distributed.state import DistState


def runs_on(owner: Any, decide: Callable[[Any], bool], name: str, function: Callable[..., Any] | None) -> Any:
    """``function`` where ``decide(state)`` holds (or in a run without several processes), ``None`` elsewhere.

    ``@accelerator.on_x`` passes the accelerator as ``owner`` and the function; ``@Accelerator.on_x`` passes the
    function as ``owner`` (then the launcher's environment says which process this is).
    """
    if function is None:
        if hasattr(owner, "engine") or not callable(owner):
            raise TypeError(f"{name} decorates a function: use it as @accelerator.{name} above a def")
        function, owner = owner, None

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state = owner.engine.state if owner is not None else DistState(init=False)
        if decide(state) or not state.use_distributed:
            return function(*args, **kwargs)
        return None

    return wrapper


@contextlib.contextmanager
def join_uneven_inputs(engine: Any, joinables: list[Any], even_batches: bool | None, default: bool) -> Iterator[None]:
    """torch's ``Join`` over DDP models when processes get different numbers of batches (``even_batches=False``);
    ``even_batches`` overrides ``default`` for the map-style loaders prepared so far, inside the block only."""
    if engine.state.num_processes == 1:
        yield
        return
    if not all(isinstance(j, Joinable) for j in joinables):  # FSDP2 modules, DeepSpeed engines
        warnings.warn(
            "join_uneven_inputs joins DDP models (torch Joinables) only; these are not, so the block runs as is: "
            "keep even_batches=True for them",
            stacklevel=3,
        )
        yield
        return
    restore: list[tuple[BatchSamplerShard, bool]] = []
    if even_batches is not None:
        for loader in engine.prepared_dataloaders:
            shard = getattr(loader, "batch_sampler", None)
            if isinstance(shard, BatchSamplerShard):
                restore.append((shard, shard.even_batches))
                shard.even_batches = even_batches
            else:
                warnings.warn(
                    "join_uneven_inputs(even_batches=...) only changes map-style dataloaders; an iterable or "
                    "dispatched one keeps its own setting",
                    stacklevel=3,
                )
    else:
        even_batches = default
    try:
        with Join(joinables, enable=not even_batches, throw_on_early_termination=False):
            yield
    finally:
        for shard, value in restore:
            shard.even_batches = value


# accelerate's answers for the ranks along parallel dimensions when no ``parallelism_config`` configures them
_UNCONFIGURED: dict[str, tuple[type[Exception], str]] = {
    "tensor_parallel_rank": (RuntimeError, "Tensor parallelism is not configured. Set `parallelism_config` first."),
    "pipeline_parallel_rank": (NotImplementedError, "Pipeline parallelism is currently not supported in Accelerate."),
    "context_parallel_rank": (NotImplementedError, "Context parallelism is currently not supported in Accelerate."),
    "data_parallel_rank": (RuntimeError, "Data parallelism is not configured. Set `parallelism_config` first."),
    "data_parallel_shard_rank": (
        RuntimeError,
        "Shard-based data parallelism is not configured. Set `parallelism_config` first.",
    ),
}


def mesh_rank(name: str, dimension: str) -> property:
    """This rank's coordinate along ``dimension`` of the engine's mesh; accelerate's error for ``name`` when the
    configuration does not enable that dimension."""
    error, message = _UNCONFIGURED[name]

    def read(accelerator: Any) -> int:
        config, built = accelerator.engine.parallelism_config, accelerator.engine.parallel_mesh
        if config is None or built is None or getattr(config, f"{dimension}_size") == 1:
            raise error(message)
        return built[dimension].get_local_rank()

    return property(read)
