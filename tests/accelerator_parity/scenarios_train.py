"""Training-loop scripts written as accelerate's examples write them; only ``ctx.api`` says whose names they use.

Every script: ``Accelerator(cpu=True, ...)`` (the examples' ``--cpu``; without it accelerate under a bare torchrun on
a machine without GPU runs each rank as its own single process), ``set_seed``, build model/optimizer/data/scheduler,
``prepare``, loop, evaluate with ``gather_for_metrics``, save the unwrapped weights. Observations go to ``ctx.rec``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import get_linear_schedule_with_warmup

from tests.parity_harness.workload import files_under

from .workload import Context, Epoch, RegressionModel, evaluate, final_weights, loader, loss_of, train_epoch

SEED = 42
EPOCHS = 2
TRAIN_N, EVAL_N, BATCH = 48, 13, 4  # 12 batches per epoch on one process, 6 per rank on two; 13 evaluates unevenly


def topology(accelerator: Any, api: Any) -> dict[str, Any]:
    kind = accelerator.distributed_type
    return {
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "is_main_process": accelerator.is_main_process,
        "device": str(accelerator.device),
        "distributed_type": getattr(kind, "value", str(kind)),
        "is_multi_cpu": kind == api.DistributedType.MULTI_CPU,
        "is_no": kind == api.DistributedType.NO,
    }


def build(ctx: Context, accelerator: Any, train_n: int = TRAIN_N, shuffle: bool = True, batch: int = BATCH) -> tuple:
    """The examples' set-up: data, model and optimizer; the scheduler sized from the unsharded loader, then prepare."""
    ctx.api.set_seed(SEED)
    train_dl = loader(train_n, batch, shuffle=shuffle)
    eval_dl = loader(EVAL_N, BATCH, seed=99)
    model = RegressionModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = len(train_dl) * EPOCHS  # before prepare: the unsharded length, as the examples compute it
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler
    )
    ctx.rec.put("len_train_dl", len(train_dl))
    ctx.rec.put("len_eval_dl", len(eval_dl))
    return model, optimizer, train_dl, eval_dl, scheduler


def fit(
    ctx: Context,
    accelerator: Any,
    prepared: tuple,
    epochs: int = EPOCHS,
    evaluate_each_epoch: bool = True,
    reduce: bool = True,
) -> None:
    """The examples' run on ``build``'s prepared objects: ``epochs`` of ``train_epoch``, the evaluation after each
    (or once at the end), the final weights, ``end_training``."""
    model, optimizer, train_dl, eval_dl, scheduler = prepared
    for epoch in range(epochs):
        train_epoch(accelerator, model, optimizer, train_dl, scheduler, Epoch(ctx.rec, epoch), reduce)
        if evaluate_each_epoch:
            evaluate(accelerator, model, eval_dl, ctx.rec, EVAL_N)
    if not evaluate_each_epoch:
        evaluate(accelerator, model, eval_dl, ctx.rec, EVAL_N)
    final_weights(accelerator, model, ctx.rec)
    accelerator.end_training()


def plain(ctx: Context) -> None:
    accelerator = ctx.api.Accelerator(cpu=True)
    ctx.rec.stage("topology", lambda: topology(accelerator, ctx.api))
    fit(ctx, accelerator, build(ctx, accelerator))


def accumulation(ctx: Context) -> None:
    """Accumulation over 2 micro-batches on 26 samples (not a multiple of 4 x 2): the last window is short."""
    accelerator = ctx.api.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer, train_dl, eval_dl, scheduler = build(ctx, accelerator, train_n=26)
    for epoch in range(EPOCHS):
        model.train()
        trace = Epoch(ctx.rec, epoch)
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = loss_of(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    ctx.rec.add("grad_norm", float(norm))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            trace.step(accelerator, batch, loss, scheduler)
        evaluate(accelerator, model, eval_dl, ctx.rec, EVAL_N)
    final_weights(accelerator, model, ctx.rec)
    accelerator.end_training()


# The interruption: after this many batches, per process count (mid-epoch 0: batch 5 of 12, 3 of 6).
STOP = {1: 5, 2: 3}


def resume(ctx: Context, shuffle: bool) -> None:
    """accelerate's checkpointing example: save_state to ``step_{N}``, a new process resumes from it.

    Phases: ``full`` (uninterrupted), ``interrupted`` (save_state after ``STOP`` batches, then stop), ``resumed``
    (load_state in a new process, then the example's ``skip_first_batches(train_dl, resume_step)`` in the resumed
    epoch, unless it is ``resume_ours_style``, where trainer_ext restores the loader's position itself), and
    ``resumed_skip_by_hand`` (the example's way again, from the same checkpoint).
    """
    skip_by_hand = ctx.phase == "resumed_skip_by_hand" or not shuffle
    resuming = ctx.phase.startswith("resumed")
    accelerator = ctx.api.Accelerator(cpu=True)
    model, optimizer, train_dl, eval_dl, scheduler = build(ctx, accelerator, shuffle=shuffle)
    checkpoint = ctx.workdir / f"step_{STOP[ctx.nproc]}"
    starting_epoch, resume_step, overall_step = 0, None, 0
    if resuming:
        accelerator.load_state(str(checkpoint))
        resumed_at = int(checkpoint.name.replace("step_", ""))
        starting_epoch = resumed_at // len(train_dl)
        resume_step = resumed_at - starting_epoch * len(train_dl)
        ctx.rec.put("resume_at", {"epoch": starting_epoch, "step": resume_step})

    def interrupt() -> bool:
        """After each step: in phase ``interrupted``, save_state at ``STOP`` and stop."""
        nonlocal overall_step
        overall_step += 1
        if ctx.phase != "interrupted" or overall_step != STOP[ctx.nproc]:
            return False
        accelerator.save_state(str(checkpoint))
        accelerator.wait_for_everyone()
        ctx.rec.put("saved_files", files_under(checkpoint))
        final_weights(accelerator, model, ctx.rec, "at_interruption")
        return True

    for epoch in range(starting_epoch, EPOCHS):
        if resume_step is not None and epoch == starting_epoch:
            active_dataloader = accelerator.skip_first_batches(train_dl, resume_step) if skip_by_hand else train_dl
            overall_step += resume_step
        else:
            active_dataloader = train_dl
        trace = Epoch(ctx.rec, epoch)
        if train_epoch(accelerator, model, optimizer, active_dataloader, scheduler, trace, after_step=interrupt):
            return
        evaluate(accelerator, model, eval_dl, ctx.rec, EVAL_N)
    final_weights(accelerator, model, ctx.rec)
    accelerator.end_training()


def resume_accelerate_style(ctx: Context) -> None:
    """Unshuffled: accelerate's shuffled resume does not continue the interrupted order (measured on one process:
    the resumed epoch 0 is a new permutation, and so is epoch 1), so stock could not be the reference."""
    resume(ctx, shuffle=False)


def resume_ours_style(ctx: Context) -> None:
    """Shuffled, resumed by ``load_state`` alone (and, phase ``resumed_skip_by_hand``, the accelerate way): only
    trainer_ext plays the resume; both must continue its uninterrupted run, and stock's."""
    resume(ctx, shuffle=True)


def join_uneven_inputs(ctx: Context) -> None:
    """DDP on uneven shards (13 samples, batch 2: 4 and 3 batches on two ranks) inside ``join_uneven_inputs``.

    No evaluation: with ``even_batches=False`` the ranks' evaluation batches do not pair up for per-batch gathers.

    Phase ``dataloader_config``: even_batches=False on the Accelerator; ``override``: the default Accelerator, and
    ``join_uneven_inputs(..., even_batches=False)`` overriding it for the loop (accelerate's docstring example).
    """
    if ctx.phase == "dataloader_config":
        accelerator = ctx.api.Accelerator(
            cpu=True, dataloader_config=ctx.api.DataLoaderConfiguration(even_batches=False)
        )
    else:
        accelerator = ctx.api.Accelerator(cpu=True)
    model, optimizer, train_dl, eval_dl, scheduler = build(ctx, accelerator, train_n=13, shuffle=False, batch=2)
    with accelerator.join_uneven_inputs([model], even_batches=False):
        for epoch in range(EPOCHS):
            train_epoch(accelerator, model, optimizer, train_dl, scheduler, Epoch(ctx.rec, epoch), reduce=False)
    ctx.rec.put("batches_after_join", sum(1 for _ in train_dl))  # the loader's own setting again
    final_weights(accelerator, model, ctx.rec)
    accelerator.end_training()
