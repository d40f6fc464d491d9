"""The start-up block: what one optimizer step means in this run, printed once by the main process.

Step semantics, stated once: the learning-rate schedule counts optimizer steps — one per accumulation
window on all ranks together — never micro-batches and never processes.
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Any

from torch.utils.data import IterableDataset
from transformers import TrainerCallback

from trainer_ext import env_vars
from trainer_ext.distributed import cpu_threads


def _length(loader: Any) -> int | None:
    """``len(loader)``, or None for a loader over an iterable dataset (or any without a length)."""
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


def _tokens_per_sample(dataset: Any, limit: int = 1000) -> tuple[float, bool] | None:
    """Mean length of ``input_ids`` over the first ``limit`` samples and whether all were equal."""
    if dataset is None or isinstance(dataset, IterableDataset):  # reading it would consume the stream
        return None
    try:
        n = min(len(dataset), limit)
        if hasattr(dataset, "select") and hasattr(dataset, "with_format"):  # datasets.Dataset: one columnar read
            lengths = [len(ids) for ids in dataset.select(range(n)).with_format(None)["input_ids"]]
        else:
            lengths = [len(dataset[i]["input_ids"]) for i in range(n)]
    except (TypeError, KeyError, IndexError, ValueError):
        return None
    if not lengths:
        return None
    return sum(lengths) / len(lengths), len(set(lengths)) == 1


def run_summary(
    *,
    world_size: int,
    per_device_batch: int,
    accumulation: int,
    batches_per_epoch: int | None,
    max_steps: int,
    precision: str,
    strategy: str,
    schedule: str,
    tokens: tuple[float, bool] | None = None,
    threads: str | None = None,
    mesh: str | None = None,
    data_parallel: int | None = None,
    context_parallel: str | None = None,
    pipeline: str | None = None,
    parallelism: str | None = None,
) -> str:
    """The block as text (a pure function so that it is tested without a run). ``mesh`` and ``data_parallel``: the
    parallelism config's mesh and its data-parallel ranks (the world over tensor- and context-parallel ranks, which
    share a batch): those ranks, not the processes, multiply the batch. ``context_parallel``: the context-parallel
    ranks and attention (:func:`_context_parallel`). ``pipeline``: the stages, schedule, microbatches and bubble
    (:func:`_pipeline`). ``parallelism``: the layout ``--parallelism auto`` chose (:func:`_auto`)."""
    ranks = world_size if data_parallel is None else data_parallel
    global_batch = ranks * per_device_batch * accumulation
    lines = [
        "***** trainer_ext: one optimizer step *****",
        f"  world size              = {world_size} ({strategy})",
    ]
    if parallelism is not None:
        lines.append(f"  parallelism             = auto: {parallelism}")
    if mesh is not None:
        shared = world_size // max(ranks, 1)
        lines += [
            f"  mesh                    = {mesh}",
            f"  data-parallel ranks     = {ranks}"
            + (
                f" (world {world_size} / {shared}: the ranks of one {_group(mesh)} share a batch)"
                if shared > 1
                else ""
            ),
        ]
    if context_parallel is not None:
        lines.append(f"  context parallel        = {context_parallel}")
    if pipeline is not None:
        lines.append(f"  pipeline parallel       = {pipeline}")
    lines += [
        f"  per-device batch        = {per_device_batch}",
        f"  accumulation steps      = {accumulation}",
        f"  global batch (samples)  = {global_batch} = {ranks} x {per_device_batch} x {accumulation}",
    ]
    if tokens is not None:
        mean, exact = tokens
        lines.append(
            f"  global batch (tokens)   = {global_batch * mean:.0f}"
            + ("" if exact else f" (approx.: mean length {mean:.1f} before padding)")
        )
    if batches_per_epoch is None:  # an iterable dataset, or a loader without a length
        lines.append("  optimizer steps / epoch = unknown (the data has no length)")
    else:
        last_window = batches_per_epoch % accumulation
        lines.append(
            f"  optimizer steps / epoch = {max(math.ceil(batches_per_epoch / accumulation), 1)}"
            + (f" (the last window of each epoch has {last_window} micro-batches)" if last_window else "")
        )
    lines += [
        f"  optimizer steps, total  = {max_steps}",
        f"  precision               = {precision}",
        f"  LR schedule             = {schedule}, counted in optimizer steps (never micro-batches or processes)",
    ]
    if threads is not None:
        lines.append(f"  CPU threads / process   = {threads}")
    return "\n".join(lines)


def _mesh(engine: Any, world_size: int) -> tuple[str | None, int | None]:
    """The engine's mesh as text and its data-parallel ranks; (None, None) without a parallelism config."""
    config = getattr(engine, "parallelism_config", None)
    if config is None:
        return None, None
    from trainer_ext.distributed.mesh.setup import describe

    if config.total_size != world_size:  # all sizes 1 on several processes: plain data parallelism
        return f"dp_replicate {world_size}", world_size
    return describe(config), config.total_size // config.non_data_parallel_size


def _auto(args: Any) -> str | None:
    """The layout ``--parallelism auto`` chose, as the CLI that chose it passed it on; None otherwise."""
    if getattr(args, "parallelism", None) != "auto":
        return None
    return os.environ.get(env_vars.PARALLELISM_AUTO) or None


def _group(mesh: str) -> str:
    """The group whose ranks share a batch, named by the mesh's dimensions: tensor- and/or context-parallel."""
    dims = {part.split()[0] for part in mesh.split(" x ")}
    if "pp" in dims:
        return "pipeline"
    if {"tp", "cp"} <= dims:
        return "tensor- and context-parallel group"
    return "context-parallel group" if "cp" in dims else "tensor-parallel group"


def _pipeline(engine: Any, model: Any) -> str | None:
    """``2 stages (layers 0-3 | 4-7), 1f1b, 4 microbatches, bubble 20%``: the pipeline's stages (their layers from
    the runtime the prepared model carries, when it does), schedule, microbatches and idle share; None without pp."""
    config = getattr(engine, "parallelism_config", None)
    if config is None or getattr(config, "pp_size", 1) <= 1:
        return None
    from trainer_ext.distributed.pipeline.schedules import describe

    ranges = getattr(getattr(model, "_trainer_ext_pipeline", None), "ranges", None)
    return describe(config.pp_size, config.pp_schedule, config.pp_microbatches, ranges)


def _context_parallel(engine: Any) -> str | None:
    """``2 ranks, all_gather attention (auto)``: the cp ranks each sequence is split over and the attention the
    engine runs (``engine.cp_backend``), with the backend asked for when it was ``auto``; None without cp."""
    used = getattr(engine, "cp_backend", None)
    config = getattr(engine, "parallelism_config", None)
    if used is None or config is None:
        return None
    asked = getattr(config, "cp_backend", None)
    return f"{config.cp_size} ranks, {used} attention" + (f" ({asked})" if asked and asked != used else "")


class RunSummaryCallback(TrainerCallback):
    """Prints :func:`run_summary` on the main process when training starts."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = weakref.ref(trainer)
        self.printed: str | None = None

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        trainer = self._trainer()
        if not state.is_world_process_zero or trainer is None or train_dataloader is None:
            return
        engine = trainer.accelerator
        precision = engine.mixed_precision
        if engine.scaler is not None:
            precision += f" (loss scaler: initial scale {engine.scaler.get_scale():g})"
        warmup = args.get_warmup_steps(state.max_steps)
        mesh, data_parallel = _mesh(engine, args.world_size)
        self.printed = run_summary(
            world_size=args.world_size,
            per_device_batch=args.train_batch_size,
            accumulation=args.gradient_accumulation_steps,
            batches_per_epoch=_length(train_dataloader),
            max_steps=state.max_steps,
            precision=precision,
            strategy=engine.strategy.name,
            schedule=f"{args.lr_scheduler_type.value if hasattr(args.lr_scheduler_type, 'value') else args.lr_scheduler_type} "
            f"with {warmup} warm-up steps",
            tokens=_tokens_per_sample(getattr(train_dataloader, "dataset", None)),
            threads=cpu_threads.current(cpu_threads.local_processes()).describe(),
            mesh=mesh,
            data_parallel=data_parallel,
            context_parallel=_context_parallel(engine),
            pipeline=_pipeline(engine, trainer.model),
            parallelism=_auto(args),
        )
        print(self.printed, flush=True)
