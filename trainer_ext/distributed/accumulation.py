"""Gradient-accumulation bookkeeping: is this micro-batch a sync boundary, and where are the dataloaders.

transformers' Trainer owns accumulation itself (it divides the loss and decides when to step); it only
tells us the boundary through ``gradient_state._set_sync_gradients`` and reads back the end of the
current dataloader. Hand-written loops use the same object through the engine.
"""

from __future__ import annotations

from typing import Any


class GradientState:
    """Sync flag of the current micro-batch plus the stack of dataloaders being iterated."""

    def __init__(self, num_steps: int = 1, plugin_kwargs: dict[str, Any] | None = None) -> None:
        self.num_steps = num_steps
        self.plugin_kwargs: dict[str, Any] = dict(plugin_kwargs or {})
        self.sync_gradients = True
        self._active_dataloaders: list[Any] = []

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = bool(sync_gradients)

    # The innermost dataloader being iterated decides end_of_dataloader / remainder, so an evaluation
    # run in the middle of a training epoch does not disturb the training loader's state.
    def _add_dataloader(self, dataloader: Any) -> None:
        self._active_dataloaders.append(dataloader)

    def _remove_dataloader(self, dataloader: Any) -> None:
        for i in range(len(self._active_dataloaders) - 1, -1, -1):
            if self._active_dataloaders[i] is dataloader:
                del self._active_dataloaders[i]
                return

    @property
    def active_dataloader(self) -> Any | None:
        return self._active_dataloaders[-1] if self._active_dataloaders else None

    @property
    def in_dataloader(self) -> bool:
        return bool(self._active_dataloaders)

    @property
    def end_of_dataloader(self) -> bool:
        dl = self.active_dataloader
        return bool(dl is not None and dl.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch of the active loader; -1 when unknown or none."""
        dl = self.active_dataloader
        return -1 if dl is None else dl.remainder

    def __repr__(self) -> str:
        return (
            f"GradientState(sync_gradients={self.sync_gradients}, end_of_dataloader={self.end_of_dataloader}, "
            f"remainder={self.remainder})"
        )
