"""``--auto_find_batch_size`` without accelerate, and without changing the run.

transformers (accelerate's ``find_executable_batch_size``) restarts its whole training loop with 0.9 times the
per-device batch on an out-of-memory error, which shrinks the global batch and restarts the schedule. Here the dataloader keeps its batch: a micro-batch that runs out of
memory is run again as row chunks (half, a quarter … of it), each chunk one more accumulation step, so the
global batch, the data order, the schedule and the loss curve stay those of the configured run. The chunk
size is kept for the rest of the run and recorded as ``state.train_batch_size``, so a resume starts at it.

Exactness: a chunk's loss is weighted by its share of the micro-batch's rows when the Trainer divides by the
accumulation steps (mean losses); token-count losses (``num_items_in_batch``) are sums over the window and need
no factor. An error in backward leaves partial gradients, so the gradients are zeroed and the window so far
(transformers prefetched it) is run again in chunks. With chunks of equal size the result is the same, bit for
bit on CPU, as a run started at the chunk size with accordingly more accumulation steps.

Several processes: each rank shrinks on its own. A micro-batch that syncs syncs once, in its last chunk, and
DDP's buffer broadcast is not repeated after a failed forward, so ranks with different chunk counts still issue
the same collectives (tested on 2 gloo ranks). Not recoverable: an error inside a backward that syncs (gradient
buckets may be in flight). Refused in TrainingArguments: FSDP2 (every forward all-gathers, so chunk counts
must agree across ranks) and DeepSpeed (it keeps its own micro-batch and accumulation).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import torch
from transformers.utils import logging

from trainer_ext.trainer import compat as _compat

logger = logging.get_logger(__name__)

_ROW_KEYS = ("input_ids", "labels", "inputs_embeds", "pixel_values", "input_values", "input_features")


def batch_rows(inputs: Any) -> int | None:
    """Rows of a micro-batch: the first dimension of ``input_ids`` (or of the first tensor); None if none."""
    if not isinstance(inputs, Mapping):
        return None
    tensors = [inputs[k] for k in _ROW_KEYS if isinstance(inputs.get(k), torch.Tensor)]
    tensors += [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    return None


def split_rows(inputs: Mapping[str, Any], rows: int, chunks: int) -> list[tuple[dict[str, Any], int]]:
    """``inputs`` cut into ``chunks`` near-equal row chunks, with their row counts.

    Tensors and lists with ``rows`` entries are cut; anything else (flags, per-batch tensors) goes to every chunk.
    """
    bounds = [len(part) for part in torch.tensor_split(torch.arange(rows), chunks)]
    starts = [sum(bounds[:i]) for i in range(chunks)]

    def cut(value: Any, start: int, size: int) -> Any:
        if isinstance(value, Mapping):
            return {k: cut(v, start, size) for k, v in value.items()}
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            return value.narrow(0, start, size)
        if isinstance(value, (list, tuple)) and len(value) == rows:
            return value[start : start + size]
        return value

    return [(cut(dict(inputs), start, size), size) for start, size in zip(starts, bounds, strict=True)]


class AutoBatchMixin:
    """Mix in before ``transformers.Trainer``: out-of-memory micro-batches run again as smaller chunks.

    Active with ``args.auto_find_batch_size``; otherwise every method defers to the Trainer unchanged.
    """

    _auto_batch_rows: int | None = None  # the largest chunk that runs; None: whole micro-batches
    _auto_batch_window: list[Any] | None = None  # the micro-batches of the current accumulation window
    _auto_batch_running: int = 0  # rows of the chunk being run (what ran out of memory)

    def _update_auto_batch_size(self, batch_size: int) -> None:
        """Keep the configured dataloader batch; a smaller saved size (from a resumed checkpoint) is the chunk."""
        full = self.args.train_batch_size
        self._train_batch_size = full  # the global batch never changes: the data position of a resume holds
        if batch_size is not None and batch_size < full:
            self._auto_batch_rows = min(batch_size, self._auto_batch_rows or batch_size)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """Remember the window: a backward out of memory runs its earlier micro-batches again."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.args.auto_find_batch_size:
            self._auto_batch_window = batch_samples
        return batch_samples, num_items_in_batch

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The Trainer's step; on out of memory, free it, halve the chunk and run again what the window needs."""
        if not self.args.auto_find_batch_size:
            return super().training_step(model, inputs, num_items_in_batch)
        state = self.accelerator.gradient_state
        # outside the Trainer's no_sync: at the window's boundary, or on every micro-batch with sync_each_batch
        synced = state.sync_gradients or bool(state.plugin_kwargs.get("sync_each_batch", False))
        window = self._auto_batch_window or []
        position = next((i for i, batch in enumerate(window) if batch is inputs), None)
        earlier = [] if position is None else window[:position]
        failed_at, retry = None, False
        while True:
            try:
                if retry and position is not None:
                    model.zero_grad(set_to_none=True)  # drop partial gradients of a failed backward
                    for batch in earlier:  # their losses are already counted: only the gradients are redone
                        self._step_in_chunks(model, batch, num_items_in_batch, synced, last_syncs=False)
                loss = self._step_in_chunks(model, inputs, num_items_in_batch, synced, last_syncs=True)
                break
            except RuntimeError as error:
                if not _compat.should_reduce_batch_size(error):
                    raise
                if self._auto_batch_running <= 1:
                    what = "a micro-batch of 1 row" if self._auto_batch_running else "a micro-batch it cannot split"
                    raise RuntimeError(
                        f"auto_find_batch_size: out of memory with {what}. No executable batch size found, reached "
                        "zero. Shorten the sequences, enable gradient checkpointing or use a device with more memory."
                    ) from error
            # outside the except block: the traceback and the activations it held are released
            self.accelerator.strategy.after_failed_forward(model)  # e.g. DDP: no second buffer broadcast
            failed_at = failed_at or self._auto_batch_running
            self._auto_batch_rows = math.ceil(self._auto_batch_running / 2)
            _compat.clear_device_cache(garbage_collection=True)
            if position is None and not retry:
                logger.warning(
                    "auto_find_batch_size: this micro-batch is not from the current accumulation window; an "
                    "out-of-memory error in backward may have left part of its gradients"
                )
            retry = True
        if failed_at is not None:
            self._log_new_shape(failed_at)
        if self._auto_batch_rows is not None:
            self.state.train_batch_size = self._auto_batch_rows  # a resume restores it (see _update_auto_batch_size)
        return loss

    def _step_in_chunks(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None,
        synced: bool,
        last_syncs: bool,
    ) -> torch.Tensor:
        """``super().training_step`` on row chunks of at most ``_auto_batch_rows`` rows; the summed loss.

        ``synced``: the call runs outside the Trainer's ``no_sync``. Then only the last chunk syncs, and only with
        ``last_syncs`` (not for a window's earlier micro-batch run again): the others run under ``no_sync`` with
        the sync flag off, so every rank syncs once per micro-batch whatever its chunk count. The Trainer divides
        a mean loss by ``current_gradient_accumulation_steps``; scaling that by rows / chunk rows weights each
        chunk by its share of the micro-batch (a token-count loss is not divided, and needs no weight).
        """
        rows = batch_rows(inputs)
        limit = self._auto_batch_rows
        if rows is None or limit is None or rows <= limit:
            chunks = [(inputs, rows)]
        else:
            chunks = split_rows(inputs, rows, math.ceil(rows / limit))
        state = self.accelerator.gradient_state
        boundary = state.sync_gradients
        accumulation = self.current_gradient_accumulation_steps
        total = None
        try:
            for index, (chunk, chunk_rows) in enumerate(chunks):
                syncs = last_syncs and index == len(chunks) - 1
                self._auto_batch_running = chunk_rows or 0
                if len(chunks) > 1:
                    self.current_gradient_accumulation_steps = accumulation * rows / chunk_rows
                state._set_sync_gradients(boundary and syncs)
                with self.accelerator.no_sync(model) if synced and not syncs else contextlib.nullcontext():
                    loss = super().training_step(model, chunk, num_items_in_batch)
                total = loss if total is None else total + loss
        finally:
            self.current_gradient_accumulation_steps = accumulation
            state._set_sync_gradients(boundary)
        return total

    def _log_new_shape(self, failed_at: int) -> None:
        """One line per out-of-memory event: the new micro-batch and accumulation, the unchanged global batch."""
        args = self.args
        chunks = math.ceil(self._train_batch_size / self._auto_batch_rows)
        accumulation = chunks * args.gradient_accumulation_steps
        global_batch = self._train_batch_size * args.gradient_accumulation_steps * args.world_size
        where = f" on rank {args.process_index}" if args.world_size > 1 else ""
        logger.warning(
            "auto_find_batch_size: out of memory at per-device batch %d%s; continuing with %d per micro-batch x %d "
            "accumulation steps (global batch %d unchanged)",
            failed_at,
            where,
            self._auto_batch_rows,
            accumulation,
            global_batch,
        )
