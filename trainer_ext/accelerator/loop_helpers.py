"""The free helpers accelerate's example loops import beside ``Accelerator``, with accelerate 1.15's behaviour:
``find_executable_batch_size`` and ``set_seed`` (``accelerate.utils``), ``get_logger`` (``accelerate.logging``).

They read the process's rank from the launcher's variables, so none needs an ``Accelerator`` built first.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer_ext.distributed.memory import clear_device_cache, should_reduce_batch_size
from trainer_ext.distributed.state import detect_topology
from trainer_ext.env_vars import LOG_LEVEL


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Decorate ``function(batch_size, ...)``: call it with ``starting_batch_size`` and, on an out-of-memory error,
    again with a smaller batch (×0.9 by default, or what ``reduce_batch_size_fn()`` returns) until it fits.

    The caller leaves the batch size out: ``train(model)`` runs ``train(batch_size, model)``. A batch size of 0
    raises ``RuntimeError``; any other error propagates at once.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size

    def shrink() -> int:
        return int(batch_size * 0.9)

    reduce = reduce_batch_size_fn or shrink

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        names = list(inspect.signature(function).parameters)
        if len(names) < len(args) + 1:  # the caller passed the batch size itself
            given = ", ".join(f"{name}={value}" for name, value in zip(names[1:], args[1:], strict=False))
            raise TypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when called."
                f"Remove this as the decorator already does so: `{function.__name__}({given})`"
            )
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
                clear_device_cache(garbage_collection=True)
                batch_size = reduce()

    return run


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, NumPy and torch (every CUDA device too); ``device_specific`` adds the process's rank to the
    seed, ``deterministic`` turns on ``torch.use_deterministic_algorithms``."""
    if device_specific:
        seed += detect_topology().rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)  # a no-op without CUDA
    if deterministic:
        torch.use_deterministic_algorithms(True)


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger that prefixes ``[RANK i]`` and logs on the main process only unless a call passes
    ``main_process_only=False``; ``in_order=True`` logs on every process, one rank after the other."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)  # report the caller's line, not ours
        return f"[RANK {detect_topology().rank}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        topology = detect_topology()
        msg, kwargs = self.process(msg, kwargs)
        if not in_order:
            if not main_process_only or topology.rank == 0:
                self.logger.log(level, msg, *args, **kwargs)
            return
        grouped = dist.is_available() and dist.is_initialized()
        for rank in range(topology.world_size):
            if rank == topology.rank:
                self.logger.log(level, msg, *args, **kwargs)
            if grouped:
                dist.barrier()

    @functools.lru_cache(None)  # noqa: B019  (one warning per message for the life of the process, by design)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning``, once per distinct message."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """``logging.getLogger(name)`` for several processes (see ``MultiProcessAdapter``); ``log_level`` (default:
    ``$ACCELERATE_LOG_LEVEL``) sets its level and the root logger's."""
    level = log_level if log_level is not None else os.environ.get(LOG_LEVEL)
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
