"""``Accelerator``: the Trainer's engine for hand-written loops, under accelerate's method names.

Migrating a loop is one import: ``from trainer_ext import Accelerator``. Differences from accelerate that
users notice are on purpose: a prepared LR scheduler steps exactly once per optimizer step, whatever
the number of processes or accumulation steps.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from .checkpointing import loop_state as checkpoint
from .distributed.data import skip_first_batches as _skip_first_batches
from .distributed.engine import Engine
from .distributed.fsdp_config import FSDPSettings, parse_fsdp
from .distributed.rules import check_precision
from .distributed.state import DistributedType, DistState
from .env_vars import GRADIENT_ACCUMULATION_STEPS as _ENV_ACCUMULATION  # what `trainer-ext launch` exports
from .env_vars import MIXED_PRECISION as _ENV_PRECISION
from .errors import ConfigError
from .trackers import TRACKERS, BlankTracker, Tracker, resolve_trackers


class PreparedScheduler:
    """Steps the wrapped LR scheduler once per real optimizer step (not per micro-batch, not per process)."""

    def __init__(self, scheduler: Any, accelerator: Accelerator, step_with_optimizer: bool = True) -> None:
        self.scheduler = scheduler
        self.accelerator = accelerator
        self.step_with_optimizer = step_with_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.accelerator.sync_gradients or self.accelerator.optimizer_step_was_skipped:
            return  # inside an accumulation window, or the fp16 scaler skipped the optimizer step
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or hasattr(obj, "get_last_lr")


class Accelerator:
    """Device placement, DDP, mixed precision, accumulation, collectives, checkpoints and trackers."""

    deepspeed_max_grad_norm: float = 1.0  # what a DeepSpeed config's gradient_clipping "auto" becomes

    def __init__(
        self,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool = False,
        device_placement: bool = True,
        log_with: str | Tracker | list[str | Tracker] | None = None,
        project_dir: str | os.PathLike | None = None,
        step_scheduler_with_optimizer: bool = True,
        even_batches: bool = True,
        seed: int | None = None,
        timeout: timedelta | None = None,
        split_batches: bool = False,
        fsdp_config: str | os.PathLike | dict | FSDPSettings | None = None,
        deepspeed_config: str | os.PathLike | dict | None = None,
    ) -> None:
        if split_batches:
            raise ConfigError("split_batches=True is not supported; give each process its own per-device batch")
        mode = mixed_precision or os.environ.get(_ENV_PRECISION) or "no"
        steps = gradient_accumulation_steps or int(os.environ.get(_ENV_ACCUMULATION) or 1)
        if steps < 1:
            raise ConfigError(f"gradient_accumulation_steps must be at least 1, got {steps}")
        state = DistState(cpu=cpu, timeout=timeout)
        check_precision(mode, state.device)
        strategy, options = None, None
        if fsdp_config is not None and deepspeed_config is not None:
            raise ConfigError("fsdp_config and deepspeed_config both shard the model; give one")
        if deepspeed_config is not None:  # resolved at prepare(), when the batch size and optimizer are known
            strategy, options = "deepspeed", {"config": deepspeed_config}
        elif fsdp_config is not None:  # FSDP2: a preset path, a dict of fsdp_config keys, or FSDPSettings
            settings = fsdp_config if isinstance(fsdp_config, FSDPSettings) else parse_fsdp(True, fsdp_config)
            strategy, options = "fsdp", {"settings": settings}
        self.engine = Engine(
            state,
            mixed_precision=mode,
            seed=seed,
            even_batches=even_batches,
            strategy=strategy,
            strategy_options=options,
        )
        self.engine.device_placement = device_placement
        self.gradient_accumulation_steps = steps
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.project_dir = str(project_dir) if project_dir is not None else None
        self.step = 0  # micro-batches seen by `accumulate`, reset at each sync boundary
        self._trackers_requested = resolve_trackers(log_with)
        self.trackers: list[Tracker] = []
        self._schedulers: list[PreparedScheduler] = []
        self._custom: list[Any] = []

    # -- who and where --------------------------------------------------------------------------
    state = property(lambda self: self.engine.state)
    device = property(lambda self: self.engine.device)
    is_main_process = property(lambda self: self.engine.is_main_process)
    is_local_main_process = property(lambda self: self.engine.is_local_main_process)
    is_last_process = property(lambda self: self.engine.state.is_last_process)
    process_index = property(lambda self: self.engine.process_index)
    local_process_index = property(lambda self: self.engine.local_process_index)
    num_processes = property(lambda self: self.engine.num_processes)
    use_distributed = property(lambda self: self.engine.state.use_distributed)
    mixed_precision = property(lambda self: self.engine.mixed_precision)
    scaler = property(lambda self: self.engine.scaler)
    sync_gradients = property(lambda self: self.engine.sync_gradients)
    gradient_state = property(lambda self: self.engine.gradient_state)
    optimizer_step_was_skipped = property(lambda self: self.engine.optimizer_step_was_skipped)

    @property
    def distributed_type(self) -> DistributedType:
        return self.engine.distributed_type

    # -- prepare --------------------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Models, optimizers, dataloaders and LR schedulers, in any order and number; same arity back.

        Models are prepared first whatever the order given (FSDP replaces their parameters and the optimizers
        are pointed at the replacements), schedulers last.
        """
        placement = device_placement or [self.engine.device_placement] * len(objects)
        if len(placement) != len(objects):
            raise ConfigError(
                f"prepare: device_placement has {len(placement)} entries for {len(objects)} objects; give one "
                "True/False per object, in the same order"
            )
        schedulers = [_is_scheduler(o) for o in objects]
        rest = [o for o, is_scheduler in zip(objects, schedulers, strict=True) if not is_scheduler]
        places = [p for p, is_scheduler in zip(placement, schedulers, strict=True) if not is_scheduler]
        self._resolve_auto_values(objects)
        prepared = self.engine.prepare(*rest, device_placement=places) if rest else ()
        remaining = iter((prepared,) if len(rest) == 1 else prepared)
        out = [self.prepare_scheduler(o) if s else next(remaining) for o, s in zip(objects, schedulers, strict=True)]
        return out[0] if len(out) == 1 else tuple(out)

    def _resolve_auto_values(self, objects: tuple[Any, ...]) -> None:
        """Let the strategy fill settings left to the loop (DeepSpeed's ``"auto"``) from what is being prepared."""
        loaders = [o for o in objects if isinstance(o, DataLoader)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        self.engine.strategy.resolve_auto_values(
            micro_batch_size=(loaders[0].batch_size or 1) if loaders else 1,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            max_grad_norm=self.deepspeed_max_grad_norm,
            optimizer_defaults=optimizers[0].defaults if optimizers else {},
            mixed_precision=self.mixed_precision,
        )

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ):
        return self.engine.prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.engine.prepare_optimizer(optimizer)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> DataLoader:
        return self.engine.prepare_dataloader(data_loader, device_placement=device_placement)

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        prepared = PreparedScheduler(scheduler, self, self.step_scheduler_with_optimizer)
        self._schedulers.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
        return _skip_first_batches(dataloader, num_batches)

    # -- the step -------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of ``loss / gradient_accumulation_steps`` (accelerate's convention for ``accumulate``)."""
        self.engine.backward(loss / self.gradient_accumulation_steps, **kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-batch: gradients sync (and optimizers/schedulers step) every N-th, and at the end of data."""
        self.step += 1
        sync = self.step % self.gradient_accumulation_steps == 0 or self.gradient_state.end_of_dataloader
        if sync:
            self.step = 0
        self.gradient_state._set_sync_gradients(sync)
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in models:
                    stack.enter_context(self.engine.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        return self.engine.no_sync(model)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.engine.autocast()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.engine.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self.engine.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the fp16 gradients of ``optimizer`` (one, a list, or every prepared one) before reading them."""
        if optimizer is None:
            self.engine.unscale_gradients()
            return
        for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
            self.engine.precision.unscale_(getattr(opt, "optimizer", opt))

    # -- processes ------------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        self.engine.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.local_main_process_first()

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run ``function`` on the main process only (``None`` elsewhere)."""

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_main_process else None

        return wrapper

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_local_main_process else None

        return wrapper

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # -- collectives ----------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        return self.engine.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        return self.engine.gather_for_metrics(input_data, use_gather_object=use_gather_object)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return self.engine.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return self.engine.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    # -- models and saving ----------------------------------------------------------------------
    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The user's module; ``keep_fp32_wrapper=False`` also removes the autocast patch of ``forward``."""
        inner = self.engine.unwrap_model(model, keep_torch_compile=keep_torch_compile)
        if not keep_fp32_wrapper:
            base = self.engine.unwrap_model(inner, keep_torch_compile=False)
            if "_original_forward" in base.__dict__:
                base.forward = base.__dict__.pop("_original_forward")
                base.__dict__.pop("_trainer_ext_autocast", None)
        return inner

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        return self.engine.get_state_dict(model, unwrap=unwrap)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save ``obj`` from the main process only: ``torch.save``, or safetensors for a dict of tensors."""
        if not self.is_main_process:
            return
        if not safe_serialization:
            torch.save(obj, f)
            return
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise ConfigError(
                f"save(safe_serialization=True) writes a dict of tensors, got {type(obj).__name__}; pass a state "
                "dict, or safe_serialization=False for other objects (torch.save)"
            )
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in obj.items()}, str(f), metadata={"format": "pt"})

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: str | int = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the unwrapped model as safetensors (split above ``max_shard_size``) from the main process.

        All ranks call it; a sharded model is gathered by its strategy (FSDP: one tensor at a time, never whole on
        one rank; DeepSpeed ZeRO-3: gathered and checked complete).
        """
        if not safe_serialization:  # transformers 5 dropped pickled weights from save_pretrained as well
            raise ConfigError(
                "save_model(safe_serialization=False) is not supported: models are written as safetensors only "
                "(from_pretrained and safetensors.torch.load_file read them); drop the argument, or use "
                "accelerator.save(accelerator.get_state_dict(model), path) for a torch.save file"
            )

        self.engine.export_model(self.unwrap_model(model, keep_torch_compile=False), save_directory, max_shard_size)
        self.wait_for_everyone()

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Extra objects with ``state_dict``/``load_state_dict`` to include in ``save_state``."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"{type(obj).__name__} has no state_dict/load_state_dict; it cannot be checkpointed")
            self._custom.append(obj)

    def _checkpoint_objects(self) -> dict[str, Any]:
        return {
            "models": [self.unwrap_model(m, keep_torch_compile=False) for m in self.engine.prepared_models],
            "optimizers": [o.optimizer for o in self.engine.prepared_optimizers],
            "schedulers": [s.scheduler for s in self._schedulers],
            "dataloaders": self.engine.prepared_dataloaders,
            "scaler": self.scaler,
            "custom": self._custom,
            "strategy": self.engine.strategy,
        }

    def _checkpoints_root(self, call: str) -> Path:
        if self.project_dir is None:
            raise ConfigError(f"{call} needs a directory, or project_dir=... set on the Accelerator")
        return Path(self.project_dir) / "checkpoints"

    def save_state(self, output_dir: str | os.PathLike | None = None) -> str:
        """All ranks: models, optimizers, schedulers, scaler, RNG of every rank, dataloader positions.

        Without ``output_dir``: ``project_dir/checkpoints/checkpoint`` (``load_state()`` finds it).
        """
        if output_dir is None:
            output_dir = self._checkpoints_root("save_state()") / "checkpoint"
        path = checkpoint.save_state(
            output_dir, self.state, **self._checkpoint_objects(), extra={"accumulation_step": self.step}
        )
        return str(path)

    def load_state(self, input_dir: str | os.PathLike | None = None) -> None:
        """All ranks, after ``prepare``: restore what ``save_state`` wrote, in the same preparation order.

        Without ``input_dir``: the newest complete checkpoint under ``project_dir/checkpoints``.
        """
        if input_dir is None:
            input_dir = checkpoint.latest_state(self._checkpoints_root("load_state()"))
        extra = checkpoint.load_state(input_dir, self.state, **self._checkpoint_objects())
        self.step = int(extra.get("accumulation_step", 0))

    # -- trackers -------------------------------------------------------------------------------
    def init_trackers(
        self, project_name: str, config: dict[str, Any] | None = None, init_kwargs: dict[str, dict] | None = None
    ) -> None:
        """Start the trackers from ``log_with`` on the main process; store ``config`` as hyper-parameters."""
        if not self.is_main_process:
            return
        init_kwargs = init_kwargs or {}
        for item in self._trackers_requested:
            if isinstance(item, Tracker):
                tracker = item
            else:
                tracker = TRACKERS[item](project_name, self.project_dir, **init_kwargs.get(item, {}))
            if config is not None:
                tracker.store_init_configuration(config)
            self.trackers.append(tracker)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker ``name`` (its backend object with ``unwrap``); where it does not run (other ranks,
        before ``init_trackers``, no ``log_with``) a blank tracker whose every call does nothing."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        requested = [item if isinstance(item, str) else item.name for item in self._trackers_requested]
        if requested and name not in requested:  # the same answer on every rank
            raise ConfigError(f"no tracker {name!r}: log_with asked for {requested}; use one of those names")
        blank = BlankTracker(name)
        return blank.tracker if unwrap else blank

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, dict] | None = None) -> None:
        """Log to every started tracker (main process only); ``log_kwargs[name]`` goes to that tracker's call."""
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def end_training(self) -> None:
        """Finish the trackers and tear the process group down."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers.clear()
        self.engine.end_training()

    def free_memory(self, *objects: Any) -> tuple[Any, ...]:
        self._schedulers.clear()
        self.step = 0
        return self.engine.free_memory(*objects)

    clear = free_memory
