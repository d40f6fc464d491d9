"""accelerate's ``Accelerator`` names that transformers and TRL read from ``trainer.accelerator``, on the engine.

TRL's scripts call ``trainer.accelerator.print``, transformers' hyperparameter search ``clear``, GRPO/RLOO write
``dataloader_config.dispatch_batches``, TRL's callbacks use ``split_between_processes``. Each means what it means
to accelerate. ``tests/test_engine_names.py`` lists every name the installed transformers and TRL read, so a new
read fails there on upgrade.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator
from typing import Any

from trainer_ext.distributed.data.split import share_of


class DataLoaderConfigView:
    """``accelerator.dataloader_config``: accelerate's ``DataLoaderConfiguration`` fields, read from and written to
    the engine (GRPO sets ``dispatch_batches = False`` before it prepares an iterable eval set)."""

    _SETTABLE = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler")  # read at prepare
    _FIELDS = (*_SETTABLE, "non_blocking", "data_seed", "use_stateful_dataloader")

    def __init__(self, engine: Any) -> None:
        object.__setattr__(self, "_engine", engine)

    def __getattr__(self, name: str) -> Any:
        if name in self._FIELDS:
            return getattr(self._engine, name)
        raise AttributeError(f"dataloader_config has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._SETTABLE:
            raise AttributeError(
                f"dataloader_config.{name} cannot be changed on trainer_ext's engine (settable: {', '.join(self._SETTABLE)})"
            )
        setattr(self._engine, name, value)

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._FIELDS)
        return f"DataLoaderConfiguration({values})"


class AccelerateNames:
    """The accelerate names an :class:`Engine` answers besides its own protocol (print, clear, splitting inputs)."""

    non_blocking = False  # accelerate's dataloader settings the engine does not offer, with accelerate's defaults
    data_seed: int | None = None
    use_stateful_dataloader = False

    @property
    def dataloader_config(self) -> DataLoaderConfigView:
        return DataLoaderConfigView(self)

    @property
    def is_last_process(self) -> bool:
        return self.state.process_index == self.state.num_processes - 1  # type: ignore[attr-defined]

    @property
    def use_distributed(self) -> bool:
        return self.state.num_processes > 1  # type: ignore[attr-defined]

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:  # type: ignore[attr-defined]
            builtins.print(*args, **kwargs)

    def clear(self, *objects: Any) -> tuple[Any, ...]:
        """accelerate's alias of ``free_memory``: forget prepared objects and release cached memory."""
        return self.free_memory(*objects)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of a list, tuple, tensor, ``datasets.Dataset`` or dict of them."""
        processes = self.state.num_processes  # type: ignore[attr-defined]
        if processes == 1:
            yield inputs
            return
        yield share_of(inputs, processes, self.state.process_index, apply_padding)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def maybe_context_parallel(
        self, buffers: Any = None, buffer_seq_dims: Any = None, no_restore_buffers: Any = None
    ) -> Iterator[None]:
        """accelerate's context-parallel block; without a context-parallel mesh it changes nothing, as there."""
        yield
