"""The ``Accelerator``'s process coordination, with accelerate's names and meaning.

Decorators that run a function on some processes only, splitting inputs between processes, a trigger any process
can pull, barriers, and ``join_uneven_inputs`` (torch's ``Join``) for data that does not divide evenly.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.algorithms.join import Join, Joinable

from trainer_ext.distributed.data.loader import BatchSamplerShard
from trainer_ext.distributed.data.split import share_of
from trainer_ext.distributed.state import DistState


def _runs_on(owner: Any, decide: Callable[[Any], bool], name: str, function: Callable[..., Any] | None) -> Any:
    """``function`` where ``decide(state)`` holds (or in a run without several processes), ``None`` elsewhere.

    ``@accelerator.on_x`` passes the function; ``@Accelerator.on_x`` passes it as ``owner`` (then the launcher's
    environment says which process this is).
    """
    if function is None:
        if isinstance(owner, ProcessesMixin) or not callable(owner):
            raise TypeError(f"{name} decorates a function: use it as @accelerator.{name} above a def")
        function, owner = owner, None

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state = owner.engine.state if owner is not None else DistState(init=False)
        if decide(state) or not state.use_distributed:
            return function(*args, **kwargs)
        return None

    return wrapper


class ProcessesMixin:
    """Who runs what: decorators, barriers, splitting inputs, triggers, uneven inputs."""

    engine: Any
    num_processes: int
    process_index: int
    device: torch.device
    even_batches: bool

    # -- run on some processes only ---------------------------------------------------------------
    def on_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: run ``function`` on the main process only (``None`` elsewhere)."""
        return _runs_on(self, lambda state: state.is_main_process, "on_main_process", function)

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: run ``function`` on the main process of each node only."""
        return _runs_on(self, lambda state: state.is_local_main_process, "on_local_main_process", function)

    def on_last_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: run ``function`` on the last process only."""
        return _runs_on(self, lambda state: state.is_last_process, "on_last_process", function)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        """Decorator: run ``function`` on process ``process_index`` only (``@accelerator.on_process(process_index=1)``)."""
        if function is None and isinstance(self, ProcessesMixin):
            return functools.partial(self.on_process, process_index=process_index)
        return _runs_on(self, lambda state: state.process_index == process_index, "on_process", function)

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Any:
        """Decorator: run ``function`` on local process ``local_process_index`` of each node only."""
        if function is None and isinstance(self, ProcessesMixin):
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return _runs_on(
            self, lambda state: state.local_process_index == local_process_index, "on_local_process", function
        )

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.engine.is_local_main_process:
            print(*args, **kwargs)

    # -- barriers -------------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        self.engine.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.local_main_process_first()

    # -- inputs ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of a list, tuple, tensor, ``datasets.Dataset`` or dict of them; the
        first ``len % num_processes`` processes get one more. ``apply_padding`` repeats the last element so every
        process gets as many (drop the extras after a ``gather``)."""
        if self.num_processes == 1:
            yield inputs
            return
        yield share_of(inputs, self.num_processes, self.process_index, apply_padding)

    # -- a flag any process can raise -------------------------------------------------------------
    def set_trigger(self) -> None:
        """Raise this process's flag; ``check_trigger`` on every process then returns True once."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called ``set_trigger`` since the last check (a collective)."""
        if getattr(self, "flag_tensor", None) is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        if self.engine.reduce(self.flag_tensor).item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    # -- uneven inputs --------------------------------------------------------------------------
    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Train or evaluate when processes get different numbers of batches: torch's ``Join`` shadows the
        collectives of the processes that ran out (``even_batches=False``). ``even_batches`` overrides the
        accelerator's for the map-style loaders prepared so far, inside the block only."""
        if self.num_processes == 1:
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
            for loader in self.engine.prepared_dataloaders:
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
            even_batches = self.even_batches
        try:
            with Join(joinables, enable=not even_batches, throw_on_early_termination=False):
                yield
        finally:
            for shard, value in restore:
                shard.even_batches = value

    # -- ranks along parallel dimensions: none is configured (accelerate's answers without a parallelism_config)
    @property
    def tensor_parallel_rank(self) -> int:
        raise RuntimeError("Tensor parallelism is not configured. Set `parallelism_config` first.")

    @property
    def pipeline_parallel_rank(self) -> int:
        raise NotImplementedError("Pipeline parallelism is currently not supported in Accelerate.")

    @property
    def context_parallel_rank(self) -> int:
        raise NotImplementedError("Context parallelism is currently not supported in Accelerate.")

    @property
    def data_parallel_rank(self) -> int:
        raise RuntimeError("Data parallelism is not configured. Set `parallelism_config` first.")

    @property
    def data_parallel_shard_rank(self) -> int:
        raise RuntimeError("Shard-based data parallelism is not configured. Set `parallelism_config` first.")

    def maybe_context_parallel(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
        """Context parallelism is not configured here: a plain block (accelerate's answer without it)."""
        return contextlib.nullcontext()
