"""Dispatching (accelerate's ``dispatch_batches``): rank 0 reads the loader and sends every rank its part.

A global batch is ``W`` consecutive batches of the wrapped loader joined together, or one batch with
``split_batches``; rank 0 broadcasts it and each rank keeps its contiguous ``1/W`` of the rows. The data is read
once, which is what a stream (an iterable dataset) needs. As in accelerate's ``DataLoaderDispatcher``, the last
global batch of ``k`` rows is cut evenly, ``k // W`` rows per rank, or when ``W`` does not divide ``k``,
``k // W + 1`` rows of it followed by the first ``W`` rows of the epoch's first batch (``even_batches`` plays no
part): the padding comes last in the gathered rows, so ``remainder = k`` lets ``gather_for_metrics`` drop it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainer_ext.distributed.accumulation import GradientState
from trainer_ext.distributed.collectives import broadcast, broadcast_object_list, send_to_device
from trainer_ext.distributed.data.batches import allocate, batch_size, copy_rows, describe, join, take
from trainer_ext.distributed.data.prepared import IteratedPosition, TrackedIteration
from trainer_ext.errors import ConfigError


class DispatchedDataLoader(IteratedPosition, TrackedIteration, DataLoader):
    """Only rank 0 iterates the wrapped loader; every rank gets its part of each global batch by broadcast.

    ``len()`` is the number of global batches; ``.dataset`` is the full dataset. Tensors travel on ``device``
    (the process group's device: CUDA under NCCL), so dispatching needs device placement.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_processes: int,
        process_index: int,
        gradient_state: GradientState,
        device: torch.device,
        split_batches: bool = False,
        drop_last: bool = False,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, **loader_kwargs)
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.gradient_state = gradient_state
        self.device = device
        self.end_of_dataloader = False
        self._drop_last = drop_last
        self.remainder = self._known_remainder()

    @property
    def total_batch_size(self) -> int | None:
        """Rows of a full global batch: the wrapped batch size, times the processes unless splitting."""
        size = getattr(self.batch_sampler, "batch_size", None)
        if size is None:
            return None
        return size if self.split_batches else size * self.num_processes

    def __len__(self) -> int:
        whole = super().__len__()
        if self.split_batches:
            return whole
        return whole // self.num_processes if self._drop_last else -(-whole // self.num_processes)

    def _known_remainder(self) -> int:
        total = self.total_batch_size
        try:
            length = len(self.dataset)
        except TypeError:
            return -1
        return -1 if self._drop_last or not total else length % total

    def _read(self, raw: Iterator[Any]) -> tuple[Any] | None:
        """Rank 0 reads the next global batch and every rank receives it: ``(batch,)``, or None at the end.

        A failure on rank 0 is sent to the other ranks too, so that none of them waits for a batch forever.
        """
        header: list[Any] = [None]
        batch = None
        if self.process_index == 0:
            want = 1 if self.split_batches else self.num_processes
            try:
                parts = [part for _, part in zip(range(want), raw, strict=False)]
                if len(parts) < want and self._drop_last:
                    parts = []
                if parts:
                    batch = send_to_device(_joined(parts), self.device)
                    header[0] = ("batch", describe(batch))
                else:
                    header[0] = ("end",)
            except Exception as error:
                header[0] = ("error", isinstance(error, ConfigError), f"{type(error).__name__}: {error}")
                broadcast_object_list(header)
                raise
        broadcast_object_list(header)
        kind = header[0][0]
        if kind == "error":
            text = f"rank 0 could not read the next batch to dispatch: {header[0][2]}"
            raise ConfigError(text) if header[0][1] else RuntimeError(text)
        if kind == "end":
            return None
        if self.process_index != 0:
            batch = allocate(header[0][1], self.device)
        return (broadcast(batch),)

    def _source(self) -> Iterator[Any]:
        # every rank creates the wrapped iterator (it draws a base seed from the global RNG): ranks stay in step
        raw = super()._source()
        ws, rank = self.num_processes, self.process_index
        first = None  # the epoch's first rows: padding for an uneven last batch
        received = self._read(raw)
        while received is not None:
            batch = received[0]
            upcoming = self._read(raw)  # one ahead, as accelerate: the last batch is known when it is cut
            n = batch_size(batch) or 0
            if first is None and not self._drop_last:
                first = copy_rows(take(batch, slice(0, ws)))
            per, last = n // ws, upcoming is None
            if last and not self._drop_last and n % ws:
                batch, per = join([batch, first]), per + 1
            if last:
                self.remainder = n
            yield take(batch, slice(rank * per, (rank + 1) * per))
            received = upcoming


def _joined(parts: list[Any]) -> Any:
    try:
        return join(parts)
    except RuntimeError as error:
        raise ConfigError(
            "dispatch_batches joins the batches of all processes into one, but they differ in shape "
            f"({error}). Pad every batch to one length, set split_batches=True (one batch is read and split), "
            "or set dispatch_batches=False (each process reads its own batches)."
        ) from error
