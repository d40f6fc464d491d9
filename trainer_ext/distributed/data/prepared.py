"""What every prepared dataloader shares: it tells the gradient state where it is, and remembers its position.

``end_of_dataloader`` is True while the last batch is in use (one batch of look-ahead) and ``remainder`` is the
number of real samples in the last global batch, so ``gather_for_metrics`` can drop the padding. Loaders that
cannot cut their sampler skip on resume by reading the skipped batches (:class:`IteratedPosition`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainer_ext.distributed.accumulation import GradientState
from trainer_ext.distributed.collectives import send_to_device
from trainer_ext.distributed.data.batches import batch_size


class TrackedIteration:
    """Look one batch ahead so ``end_of_dataloader`` is True while the last batch is in use, and tell the
    gradient state which loader is active (an evaluation inside a training epoch has its own state)."""

    gradient_state: GradientState
    device: torch.device | None
    end_of_dataloader: bool
    remainder: int

    def _on_iter_start(self) -> None:
        """Hook for loaders that remember where a pass started."""

    def _on_last_batch(self, batch: Any) -> None:
        """Hook called with the last batch before it is handed out."""

    def _on_iter_end(self) -> None:
        """Hook called once a pass has handed out its last batch."""

    def _take_pending_skip(self) -> int:
        """Batches to read and drop at the start of this pass (loaders that skip by iterating)."""
        return 0

    def _source(self) -> Iterator[Any]:
        """This rank's batches, before placement: the DataLoader's own unless a subclass dispatches or shards."""
        return super().__iter__()  # type: ignore[misc]

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader = False
        self.batches_yielded = 0
        self._on_iter_start()
        self.gradient_state._add_dataloader(self)
        try:
            iterator = self._source()
            skip = self._take_pending_skip()
            if skip:
                iterator = itertools.islice(iterator, skip, None)
            try:
                current = next(iterator)
            except StopIteration:
                self._on_iter_end()  # an empty pass is a finished pass
                return
            while True:
                try:
                    upcoming = next(iterator)
                except StopIteration:
                    self._on_last_batch(current)
                    self.end_of_dataloader = True
                    self.batches_yielded += 1
                    yield self._place(current)
                    return
                self.batches_yielded += 1
                yield self._place(current)
                current = upcoming
        finally:
            if self.end_of_dataloader:
                self._on_iter_end()
            self.gradient_state._remove_dataloader(self)

    def _place(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        return send_to_device(batch, self.device, non_blocking=self.pin_memory)  # type: ignore[attr-defined]


class IteratedPosition:
    """Epoch and batches handed out, for loaders that resume by reading (and dropping) the batches already seen.

    Each pass starts by handing its epoch to the sampler or the dataset (``set_epoch``), and a pass that ran to
    the end moves to the next epoch, so a loop that never calls ``set_epoch`` still gets a new order each pass.
    """

    _epoch = 0
    _finished_pass = False
    pending_skip = 0  # one-shot: read and dropped by the next pass only (resume from a saved position)
    batches_yielded = 0
    end_of_dataloader = False

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        self._epoch, self._finished_pass = int(epoch), False
        sampler = getattr(self, "batch_sampler", None)
        targets = [obj for obj in (sampler, getattr(sampler, "sampler", None)) if hasattr(obj, "set_epoch")]
        if not targets and hasattr(getattr(self, "dataset", None), "set_epoch"):
            targets = [self.dataset]  # type: ignore[attr-defined]
        for obj in targets:
            obj.set_epoch(self._epoch)

    def _on_iter_start(self) -> None:
        self.set_epoch(self._epoch + 1 if self._finished_pass else self._epoch)
        self._iter_epoch = self._epoch
        self._iter_skip = self.pending_skip

    def _on_iter_end(self) -> None:
        self._finished_pass = True

    def _take_pending_skip(self) -> int:
        skip, self.pending_skip = self.pending_skip, 0
        return skip

    def state_dict(self) -> dict[str, int]:
        """Where this rank is: the epoch being read and the batches of it already handed out."""
        if not hasattr(self, "_iter_epoch"):
            return {"epoch": self._epoch + int(self._finished_pass), "batches": self.pending_skip}
        if self.end_of_dataloader:  # a finished pass: the next one starts the next epoch
            return {"epoch": self._iter_epoch + 1, "batches": 0}
        return {"epoch": self._iter_epoch, "batches": self._iter_skip + self.batches_yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``: same epoch; the next pass reads and drops the batches already seen."""
        self.set_epoch(int(state["epoch"]))
        self.pending_skip = int(state["batches"])
        for name in ("_iter_epoch", "_iter_skip"):
            self.__dict__.pop(name, None)

    def skip(self, num_batches: int) -> SkippingPass:
        """This loader starting each pass after its first ``num_batches`` batches (read and dropped).

        It replaces a position restored by ``load_state`` (accelerate's resume calls both: the batches are skipped
        once, not twice); iterating this loader itself afterwards reads the next epoch in full.
        """
        self.pending_skip = 0
        return SkippingPass(self, int(num_batches))


class SkippingPass:
    """A loader with resume-by-reading whose every pass skips its first ``num_batches`` batches (``skip_first_batches``).

    Attributes are the wrapped loader's; its position (``state_dict``) counts the skipped batches as read.
    """

    def __init__(self, loader: IteratedPosition, num_batches: int) -> None:
        self.loader, self.num_batches = loader, num_batches

    def __iter__(self) -> Iterator[Any]:
        self.loader.pending_skip = self.num_batches  # replaces, never adds to, a restored position
        return iter(self.loader)

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.num_batches)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class TrackedDataLoader(IteratedPosition, TrackedIteration, DataLoader):
    """An unsharded loader (an iterable dataset on one process) that still reports where it is.

    ``remainder`` becomes the size of the last batch once it is read: transformers repeats each batch's loss
    ``eval_batch_size`` times and relies on it to drop the extra copies of a short last batch.
    """

    def __init__(
        self, dataset: Any, *, gradient_state: GradientState, device: torch.device | None = None, **kwargs: Any
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.gradient_state = gradient_state
        self.device = device
        self.end_of_dataloader = False
        self.remainder = -1

    @property
    def total_batch_size(self) -> int | None:
        return self.batch_size

    def _on_last_batch(self, batch: Any) -> None:
        size = batch_size(batch)
        self.remainder = -1 if size is None else size
