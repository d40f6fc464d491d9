"""What ``Accelerator.prepare`` adds to the engine's preparation, with accelerate's rules.

Schedulers are prepared last (stepped by accelerate's rule, or by DeepSpeed's engine for a ``DummyScheduler``); the
strategy sees the loop's optimizer, schedule and batch size first (DeepSpeed's placeholders and ``"auto"`` values);
each model DDP wrapped gets the ``DistributedDataParallelKwargs`` communication hook.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainer_ext.accelerator.options import DistributedDataParallelKwargs
from trainer_ext.accelerator.scheduler import PreparedScheduler, is_scheduler
from trainer_ext.distributed.strategies.deepspeed.plugin import DummyOptim, DummyScheduler, SteppedByEngine
from trainer_ext.errors import ConfigError


def schedulers_among(objects: tuple[Any, ...], placement: list[bool]) -> list[bool]:
    """Which of ``prepare``'s objects are LR schedulers (a ``DummyScheduler`` too), after checking ``placement``."""
    if len(placement) != len(objects):
        raise ConfigError(
            f"prepare: device_placement has {len(placement)} entries for {len(objects)} objects; give one "
            "True/False per object, in the same order"
        )
    return [is_scheduler(o) or isinstance(o, DummyScheduler) for o in objects]


def show_loop_objects(
    engine: Any,
    objects: tuple[Any, ...],
    schedulers: list[bool],
    *,
    split_batches: bool,
    accumulation_steps: int,
    max_grad_norm: float,
) -> None:
    """Let the strategy check the optimizer and scheduler against its own (DeepSpeed's blocks, placeholders) and
    fill the settings left to the loop (DeepSpeed's ``"auto"``) from what is being prepared."""
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer | DummyOptim)]
    scheduler = next((o for o, s in zip(objects, schedulers, strict=True) if s), None)
    schedule = None
    if isinstance(scheduler, DummyScheduler):
        # accelerate's reading: the total was counted over the unsharded loader, once per process
        total = scheduler.total_num_steps
        if total is not None and not split_batches:
            total = math.ceil(total / engine.num_data_parallel_processes)
        schedule = (total, scheduler.warmup_num_steps)
    engine.strategy.take_loop_objects(optimizers[0] if optimizers else None, scheduler, schedule)
    loaders = [o for o in objects if isinstance(o, DataLoader)]
    defaults = {}
    if optimizers:
        first = optimizers[0]
        defaults = first.hyper_parameters() if isinstance(first, DummyOptim) else first.defaults
    engine.strategy.resolve_auto_values(
        micro_batch_size=(loaders[0].batch_size or 1) if loaders else 1,
        gradient_accumulation_steps=accumulation_steps,
        max_grad_norm=max_grad_norm,
        optimizer_defaults=defaults,
        mixed_precision=engine.mixed_precision,
    )


def refuse_lone_dummy_optim(prepared: list[Any]) -> None:
    """A ``DummyOptim`` still there after ``prepare``: its model was not in the same call."""
    if any(isinstance(o, DummyOptim) for o in prepared):
        raise ConfigError(
            "a DummyOptim is built by DeepSpeed together with its model: pass the model and the DummyOptim to the "
            "same prepare() call"
        )


def register_comm_hook(handler: DistributedDataParallelKwargs | None, obj: Any) -> None:
    """``DistributedDataParallelKwargs(comm_hook=...)``: installed on each model DDP wrapped, as in accelerate."""
    ddp = isinstance(obj, torch.nn.parallel.DistributedDataParallel)
    if ddp and handler is not None and not getattr(obj, "_trainer_ext_comm_hook", False):
        handler.register_comm_hook(obj)
        obj._trainer_ext_comm_hook = True


def refuse_device_map(spread: bool, num_processes: int, evaluation_mode: bool) -> None:
    """A model spread over devices by ``device_map`` trains on one process only (accelerate's rule)."""
    if spread and num_processes > 1 and not evaluation_mode:
        raise ConfigError(
            "You can't train a model that has been loaded with `device_map='auto'` in any distributed mode. "
            "Load it on one device per process (no device_map), or run it on one process"
        )


def spread_by_device_map(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or a submodule) was spread over several devices by a device map (``hf_device_map``)."""
    return any(len(getattr(module, "hf_device_map", None) or {}) > 1 for module in model.modules())


def prepared_scheduler(
    engine: Any, scheduler: Any, accelerator: Any, step_with_optimizer: bool
) -> tuple[PreparedScheduler | SteppedByEngine, bool]:
    """The scheduler a loop steps, and whether it is new (one of ours, to include in ``save_state``): stepped by
    accelerate's rule, or, for a ``DummyScheduler``, the one DeepSpeed built with its engine."""
    if isinstance(scheduler, PreparedScheduler | SteppedByEngine):
        return scheduler, False
    if isinstance(scheduler, DummyScheduler):
        built = engine.strategy.backend_scheduler()
        if built is None:
            raise ConfigError(
                "a DummyScheduler stands for the scheduler DeepSpeed builds with its engine: pass it to the same "
                "prepare() call as the model and optimizer"
            )
        return SteppedByEngine(built), False
    return PreparedScheduler(scheduler, accelerator, step_with_optimizer), True
