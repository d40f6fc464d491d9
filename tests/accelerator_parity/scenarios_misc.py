"""Scripts for the Accelerator's other members: checkpoint rotation, trackers, splitting inputs, uneven
evaluation, saving models and kwargs handlers. Written once; ``ctx.api`` picks accelerate's or trainer_ext's names."""

from __future__ import annotations

import json
import logging
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tests.parity_harness.workload import files_under

from .scenarios_train import EPOCHS, EVAL_N, build
from .workload import (
    Context,
    Epoch,
    RegressionModel,
    evaluate,
    final_weights,
    loader,
    loss_of,
    tiny_llama,
    train_epoch,
)


def checkpoint_rotation(ctx: Context) -> None:
    """Automatic checkpoint naming with ``total_limit=2``: ``save_state()`` after each of 3 epochs."""
    project_dir = ctx.workdir / "project"
    config = ctx.api.ProjectConfiguration(
        project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=2
    )
    accelerator = ctx.api.Accelerator(cpu=True, project_config=config)
    model, optimizer, train_dl, eval_dl, scheduler = build(ctx, accelerator, train_n=16)
    for epoch in range(3):
        train_epoch(accelerator, model, optimizer, train_dl, scheduler, Epoch(ctx.rec, epoch))
        saved = accelerator.save_state()
        accelerator.wait_for_everyone()
        ctx.rec.add("save_state_returned", str(saved))  # written relative to <WORKDIR>
        ctx.rec.add("checkpoints_after_save", sorted(p.name for p in (project_dir / "checkpoints").glob("*")))
    accelerator.wait_for_everyone()
    ctx.rec.put("project_files", files_under(project_dir))
    accelerator.end_training()


TIMESTAMP = re.compile(r"^\d{9,}(\.\d+)?$")


def normalised_path(relative: str) -> str:
    """Event file names and ``add_hparams``' timestamp folders carry the clock, host and pid: blank them."""
    parts = [
        "<time>" if TIMESTAMP.match(part) else re.sub(r"^events\.out\.tfevents\..*$", "events.out.tfevents.*", part)
        for part in Path(relative).parts
    ]
    return "/".join(parts)


def read_events(root: Path) -> dict[str, Any]:
    """Every folder with event files under ``root``: its tags by kind, and each scalar's (step, value) list."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs: dict[str, Any] = {}
    for folder in sorted({p.parent for p in root.rglob("events.out.tfevents.*")}):
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        tags = {kind: sorted(names) for kind, names in events.Tags().items() if isinstance(names, list) and names}
        scalars = {tag: [[e.step, e.value] for e in events.Scalars(tag)] for tag in tags.get("scalars", [])}
        runs[normalised_path(str(folder.relative_to(root)))] = {"tags": tags, "scalars": scalars}
    return runs


def trackers(ctx: Context) -> None:
    """TensorBoard through ``log_with``: config, a loss and LR per step, an eval metric per epoch."""
    project_dir = ctx.workdir / "runs"
    accelerator = ctx.api.Accelerator(cpu=True, log_with="tensorboard", project_dir=str(project_dir))
    model, optimizer, train_dl, eval_dl, scheduler = build(ctx, accelerator, train_n=16)
    accelerator.init_trackers("parity_run", config={"lr": 1e-2, "epochs": EPOCHS, "batch_size": 4, "opt": "AdamW"})
    ctx.rec.put("trackers_on_this_rank", len(accelerator.trackers))
    step = 0
    for _ in range(EPOCHS):
        model.train()
        for batch in train_dl:
            loss = loss_of(model, batch)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            accelerator.log({"loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)
        evaluate(accelerator, model, eval_dl, ctx.rec, EVAL_N)
        accelerator.log({"eval_mse": ctx.rec.data["eval"][-1]["metric"]}, step=step)
    accelerator.end_training()
    if accelerator.is_main_process:  # it wrote the files itself: no barrier needed to read them
        ctx.rec.put("layout", sorted(normalised_path(f) for f in files_under(project_dir)))
        ctx.rec.stage("events", lambda: read_events(project_dir))
    ctx.rec.stage("wait_for_everyone_after_end_training", accelerator.wait_for_everyone)


def describe(part: Any) -> Any:
    """A part as the script sees it: its type, and its values (tensors with shape and dtype)."""
    if isinstance(part, torch.Tensor):
        return {"tensor": part.tolist(), "shape": list(part.shape), "dtype": str(part.dtype)}
    if isinstance(part, dict):
        return {"dict": {k: describe(v) for k, v in part.items()}}
    return {type(part).__name__: [describe(v) if isinstance(v, (torch.Tensor, dict)) else v for v in part]}


def split_between_processes(ctx: Context) -> None:
    accelerator = ctx.api.Accelerator(cpu=True)
    cases: dict[str, Any] = {
        "list1": ["only"],
        "list5": ["a", "b", "c", "d", "e"],
        "list6": [0, 1, 2, 3, 4, 5],
        "tuple5": (10, 11, 12, 13, 14),
        "tensor5": torch.arange(10).reshape(5, 2),
        "tensor6": torch.arange(6.0),
        "dict5": {"prompt": ["p0", "p1", "p2", "p3", "p4"], "ids": torch.arange(5)},
    }

    def split(inputs: Any, padding: bool) -> Any:
        with accelerator.split_between_processes(inputs, apply_padding=padding) as part:
            return describe(part)

    for padding in (False, True):
        for name, inputs in cases.items():
            ctx.rec.stage(f"{name}_padding={padding}", lambda i=inputs, p=padding: split(i, p))
    accelerator.end_training()


def uneven_eval(ctx: Context) -> None:
    """Evaluation of 13 and 17 samples in batches of 4: every sample must be gathered exactly once.

    Phase ``even_batches`` (the default Accelerator): ``gather_for_metrics`` after each batch. Phase
    ``uneven_batches`` (``DataLoaderConfiguration(even_batches=False)``): ranks may get different numbers and sizes
    of batches, so a collective per batch would not pair up; the script keeps its predictions and gathers them once
    at the end, as Python objects.
    """
    uneven = ctx.phase == "uneven_batches"
    config = ctx.api.DataLoaderConfiguration(even_batches=False) if uneven else None
    accelerator = ctx.api.Accelerator(cpu=True, dataloader_config=config) if uneven else ctx.api.Accelerator(cpu=True)
    ctx.api.set_seed(0)
    model = accelerator.prepare(RegressionModel())
    for n in (13, 17):
        eval_dl = accelerator.prepare(loader(n, 4, seed=n))
        ctx.rec.put(f"len_eval_dl_{n}", len(eval_dl))
        if not uneven:
            evaluate(accelerator, model, eval_dl, ctx.rec, n, key=f"eval_{n}")
            continue
        local = []
        for batch in eval_dl:
            with torch.no_grad():
                error = (model(batch["x"]) - batch["y"]).pow(2).squeeze(-1)
            local += [(i, e) for i, e in zip(batch["idx"].tolist(), error.tolist(), strict=True)]
        ctx.rec.put(f"local_ids_{n}", [i for i, _ in local])
        gathered = accelerator.gather_for_metrics(local, use_gather_object=True)
        ids = [i for i, _ in gathered]
        mse = sum(e for _, e in gathered) / max(len(gathered), 1)
        ctx.rec.add(f"eval_{n}", {"count": len(ids), "ids": ids, "metric": mse, "dataset_len": n})
    objects = accelerator.gather_for_metrics([f"rank{accelerator.process_index}"], use_gather_object=True)
    ctx.rec.put("gathered_objects", objects)
    accelerator.end_training()


def save_variant(accelerator: Any, model: nn.Module, directory: Path, ctx: Context, **kwargs: Any) -> dict[str, Any]:
    accelerator.save_model(model, str(directory), **kwargs)
    accelerator.wait_for_everyone()
    files = files_under(directory)
    tensors: dict[str, torch.Tensor] = {}
    metadata = {}
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(str(directory / name), framework="pt") as handle:
                metadata[name] = handle.metadata()
                tensors.update({key: handle.get_tensor(key) for key in handle.keys()})  # noqa: SIM118
    ctx.rec.tensors(directory.name, tensors)
    index = directory / "model.safetensors.index.json"
    return {
        "files": files,
        "metadata": metadata,
        "index": json.loads(index.read_text()) if index.exists() else None,
        "dtypes": sorted({str(t.dtype) for t in tensors.values()}),
    }


def save_model(ctx: Context) -> None:
    """``save_model`` of a plain module (3 x Linear(64, 64), ~50 KB) and of a tiny Llama, whole and in 20KB shards."""
    accelerator = ctx.api.Accelerator(cpu=True)
    ctx.api.set_seed(0)
    models = {
        "module": nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)),
        "pretrained": tiny_llama(),
    }
    for kind, model in models.items():
        prepared = accelerator.prepare(model)
        for label, kwargs in (("default", {}), ("20KB", {"max_shard_size": "20KB"})):
            directory = ctx.workdir / f"{kind}_{label}"
            ctx.rec.stage(
                f"{kind}_{label}", lambda p=prepared, d=directory, k=kwargs: save_variant(accelerator, p, d, ctx, **k)
            )
    accelerator.end_training()


def kwargs_handlers(ctx: Context) -> None:
    """The kwargs handlers a script passes (DDP options, process-group timeout, autocast, scaler, profiler), what
    the prepared model carries of them, two training steps, and ``accelerator.profile()``."""
    api = ctx.api
    handlers = [
        api.DistributedDataParallelKwargs(broadcast_buffers=False, bucket_cap_mb=1, gradient_as_bucket_view=True),
        api.InitProcessGroupKwargs(timeout=timedelta(seconds=300)),
        api.AutocastKwargs(enabled=False),
        api.GradScalerKwargs(init_scale=1024.0),
        api.ProfileKwargs(activities=["cpu"]),
    ]
    accelerator = api.Accelerator(cpu=True, kwargs_handlers=handlers)
    model, optimizer, train_dl, eval_dl, scheduler = build(ctx, accelerator, train_n=8)
    options = ("find_unused_parameters", "broadcast_buffers", "bucket_bytes_cap", "gradient_as_bucket_view")
    ctx.rec.put("prepared_model", {"type": type(model).__name__} | {k: getattr(model, k, None) for k in options})
    ctx.rec.put("mixed_precision", str(accelerator.mixed_precision))
    ctx.rec.put("scaler", None if accelerator.scaler is None else type(accelerator.scaler).__name__)
    train_epoch(accelerator, model, optimizer, train_dl, scheduler, Epoch(ctx.rec, 0))

    def profiled() -> dict[str, Any]:
        with accelerator.profile() as prof, torch.no_grad():
            model(torch.ones(2, 4))
        return {"type": f"{type(prof).__module__}.{type(prof).__name__}", "has_events": len(prof.key_averages()) > 0}

    ctx.rec.stage("profile", profiled)
    final_weights(accelerator, model, ctx.rec)
    accelerator.end_training()


class _Lines(logging.Handler):
    """Keeps what a logger emits on this rank: level and message."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def memory_example(ctx: Context) -> None:
    """by_feature/memory.py: the whole loop under ``find_executable_batch_size`` (a real allocator error above batch
    20: 32, 28, 25, 22 fail), ``get_logger`` with every kind of call, ``set_seed(device_specific=True)``."""
    accelerator = ctx.api.Accelerator(cpu=True)
    logger = ctx.api.get_logger("parity.memory", log_level="INFO")
    lines = _Lines()
    logging.getLogger("parity.memory").addHandler(lines)
    ctx.api.set_seed(7, device_specific=True)
    ctx.rec.put("draw_after_device_specific_seed", torch.rand(2).tolist())
    tried: list[int] = []

    @ctx.api.find_executable_batch_size(starting_batch_size=32)
    def inner_training_loop(batch_size: int) -> None:
        nonlocal accelerator
        accelerator.free_memory()
        tried.append(batch_size)
        if batch_size > 20:
            torch.empty(2**62, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
        model, optimizer, train_dl, eval_dl, scheduler = build(ctx, accelerator, batch=batch_size)
        for epoch in range(EPOCHS):
            trace = Epoch(ctx.rec, epoch)
            train_epoch(accelerator, model, optimizer, train_dl, scheduler, trace)
            logger.info(f"epoch {epoch}: last loss {trace.entry['loss'][-1]:.6f}")
        evaluate(accelerator, model, eval_dl, ctx.rec, EVAL_N)
        logger.info(f"rank {accelerator.process_index} done", main_process_only=False)
        logger.warning_once("said once")
        logger.warning_once("said once")
        logger.info("in order", in_order=True)
        logger.debug("below the level")

    inner_training_loop()
    ctx.rec.stage("batch_size_passed_twice", lambda: inner_training_loop(8))
    ctx.rec.put("batch_sizes_tried", tried)
    ctx.rec.put("log_lines", lines.lines)
    logging.getLogger("parity.memory").removeHandler(lines)
    accelerator.end_training()


def local_sgd(ctx: Context) -> None:
    """by_feature/local_sgd.py: ``LocalSGD(local_sgd_steps=3)`` around an accumulating loop (2 micro-batches per
    step, gradients never all-reduced), the weights averaged every 3 optimizer steps and on leaving the block."""
    accelerator = ctx.api.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer, train_dl, eval_dl, scheduler = build(ctx, accelerator)
    with ctx.api.LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=3, enabled=True) as local:
        for epoch in range(EPOCHS):
            model.train()
            trace = Epoch(ctx.rec, epoch)
            for batch in train_dl:
                with accelerator.accumulate(model):
                    loss = loss_of(model, batch)
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                    local.step()
                trace.step(accelerator, batch, loss, scheduler)
                if accelerator.sync_gradients:
                    first = next(accelerator.unwrap_model(model).parameters()).detach()
                    ctx.rec.add("first_weight_sum", float(first.sum()))
        ctx.rec.put("enabled_and_steps", [local.enabled, local.num_steps])
    evaluate(accelerator, model, eval_dl, ctx.rec, EVAL_N)
    final_weights(accelerator, model, ctx.rec)
    accelerator.end_training()
