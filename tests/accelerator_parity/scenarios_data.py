"""Loader options in accelerate-style loops: iterable datasets (dispatched or read by every rank), ``split_batches``,
``dispatch_batches`` on map-style data with a short last batch, and a mid-epoch resume over a stream.

Each script trains 2 epochs and evaluates with ``gather_for_metrics``; the data sizes leave a short last batch on 1
and 2 processes, where the implementations could cut it differently.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import get_linear_schedule_with_warmup

from .scenarios_train import EPOCHS, EVAL_N, SEED, fit
from .workload import Context, Epoch, RegressionData, RegressionModel, evaluate, final_weights, loader, train_epoch

TRAIN_N, BATCH = 22, 4  # 2 processes: global batches of 8, 8 and 6 (6 rows left: how are they cut?)


class RegressionStream(IterableDataset):
    """The rows of :class:`RegressionData` as a stream without a length (the usual iterable dataset)."""

    def __init__(self, n: int, seed: int = 1234) -> None:
        self.rows = RegressionData(n, seed)

    def __iter__(self):
        return (self.rows[i] for i in range(len(self.rows)))


def _accelerator(ctx: Context, **loader_options: Any) -> Any:
    config = ctx.api.DataLoaderConfiguration(**loader_options) if loader_options else None
    return ctx.api.Accelerator(cpu=True, dataloader_config=config)


def _length(dataloader: Any) -> int | None:
    try:
        return len(dataloader)
    except TypeError:  # a stream has no length
        return None


def _build(ctx: Context, accelerator: Any, stream: bool, shuffle: bool = True, drop_last: bool = False) -> tuple:
    """The examples' set-up; a stream's scheduler is sized from the known number of samples, as a script would."""
    ctx.api.set_seed(SEED)
    if stream:
        train_dl = DataLoader(RegressionStream(TRAIN_N), batch_size=BATCH)
    else:
        train_dl = loader(TRAIN_N, BATCH, shuffle=shuffle, drop_last=drop_last)
    eval_dl = loader(EVAL_N, BATCH, seed=99)
    model = RegressionModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = math.ceil(TRAIN_N / BATCH) * EPOCHS
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    prepared = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
    ctx.rec.put("len_train_dl", _length(prepared[2]))
    ctx.rec.put("len_eval_dl", _length(prepared[3]))
    return prepared


def _train(
    ctx: Context, accelerator: Any, stream: bool, shuffle: bool = True, epochs: int = EPOCHS, **kw: Any
) -> None:
    fit(ctx, accelerator, _build(ctx, accelerator, stream, shuffle, **kw), epochs)


def _stream_eval(ctx: Context, accelerator: Any, key: str) -> None:
    """``gather_for_metrics`` over an evaluation stream (13 rows), recorded under ``key``."""
    eval_dl = accelerator.prepare(DataLoader(RegressionStream(EVAL_N, seed=99), batch_size=BATCH))
    torch.manual_seed(0)
    evaluate(accelerator, RegressionModel(), eval_dl, ctx.rec, EVAL_N, key=key)


def iterable_dataset(ctx: Context) -> None:
    """A stream: phase ``dispatch`` (accelerate's default for an iterable: rank 0 reads, the ranks get their rows)
    and ``read_by_every_rank`` (``dispatch_batches=False``: each rank reads the stream and keeps its share)."""
    dispatched = ctx.phase == "dispatch"
    accelerator = _accelerator(ctx) if dispatched else _accelerator(ctx, dispatch_batches=False)
    # read by every rank, stock's gather_for_metrics keeps the repeats of the last group (compare.ALLOWED)
    _stream_eval(ctx, accelerator, "eval_stream")
    _train(ctx, accelerator, stream=True)


def split_batches(ctx: Context) -> None:
    """``split_batches=True``: each batch of 4 is cut between the processes (the scheduler steps once per batch)."""
    _train(ctx, _accelerator(ctx, split_batches=True), stream=False)


def dispatch_batches(ctx: Context) -> None:
    """``dispatch_batches=True`` on shuffled map-style data: 22 rows leave a last global batch of 6 on 2 processes
    (and an evaluation batch of 5 of 13)."""
    _train(ctx, _accelerator(ctx, dispatch_batches=True), stream=False)


def shuffle_drop_last(ctx: Context) -> None:
    """accelerate's examples' training loader: shuffled, ``drop_last=True``; 22 rows make 5 batches of 4, not a
    multiple of 2 or 3 processes, so the last round is dropped; 4 epochs (each epoch's order follows the last)."""
    _train(ctx, _accelerator(ctx), stream=False, drop_last=True, epochs=4)


# The interruption over the stream: after this many batches (mid-epoch 0: batch 3 of 6, 1 of 3).
STOP = {1: 3, 2: 1}


def _resume(ctx: Context, **loader_options: Any) -> None:
    """accelerate's checkpointing example over a stream. Phases: ``full``, ``interrupted`` (save_state after ``STOP``
    batches), ``resumed`` (load_state + ``skip_first_batches`` for the resumed epoch, accelerate's way) and, ours
    only, ``resumed_by_load_state`` (load_state alone restores the loader's position)."""
    accelerator = _accelerator(ctx, **loader_options)
    model, optimizer, train_dl, eval_dl, scheduler = _build(ctx, accelerator, stream=True)
    per_epoch = math.ceil(TRAIN_N / (BATCH * ctx.nproc))
    checkpoint = ctx.workdir / f"step_{STOP[ctx.nproc]}"
    starting_epoch, resume_step, overall_step = 0, None, 0
    if ctx.phase.startswith("resumed"):
        accelerator.load_state(str(checkpoint))
        starting_epoch, resume_step = divmod(STOP[ctx.nproc], per_epoch)
        ctx.rec.put("resume_at", {"epoch": starting_epoch, "step": resume_step})

    def interrupt() -> bool:
        """After each step: in phase ``interrupted``, save_state at ``STOP`` and stop."""
        nonlocal overall_step
        overall_step += 1
        if ctx.phase != "interrupted" or overall_step != STOP[ctx.nproc]:
            return False
        accelerator.save_state(str(checkpoint))
        accelerator.wait_for_everyone()
        final_weights(accelerator, model, ctx.rec, "at_interruption")
        return True

    for epoch in range(starting_epoch, EPOCHS):
        active = train_dl
        if resume_step is not None and epoch == starting_epoch:
            overall_step += resume_step
            if ctx.phase == "resumed":
                active = accelerator.skip_first_batches(train_dl, resume_step)
        if train_epoch(accelerator, model, optimizer, active, scheduler, Epoch(ctx.rec, epoch), after_step=interrupt):
            return
        evaluate(accelerator, model, eval_dl, ctx.rec, EVAL_N)
    final_weights(accelerator, model, ctx.rec)
    accelerator.end_training()


def resume_iterable(ctx: Context) -> None:
    """Mid-epoch resume over a stream with accelerate's default (dispatched on 2 processes)."""
    _resume(ctx)


def resume_iterable_read_by_every_rank(ctx: Context) -> None:
    """The same with ``dispatch_batches=False``: every rank reads the stream (and the skipped batches) itself."""
    _resume(ctx, dispatch_batches=False)
