"""``Accelerator``: the Trainer's engine for hand-written loops, under accelerate's names and meaning.

Migrating a loop is one import: ``from trainer_ext import Accelerator`` (and ``ProjectConfiguration``,
``DataLoaderConfiguration`` and the kwargs handlers from ``trainer_ext`` instead of ``accelerate.utils``). What
such a script observes is accelerate's behaviour, including how a prepared LR scheduler steps; trainer_ext's own
choices are opt-in (``scheduler_counts_optimizer_steps=True``, ``fsdp_config=``, ``deepspeed_config=``).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainer_ext.accelerator.checkpoints import CheckpointsMixin
from trainer_ext.accelerator.options import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
    split_handlers,
)
from trainer_ext.accelerator.processes import ProcessesMixin
from trainer_ext.accelerator.scheduler import PreparedScheduler, is_scheduler
from trainer_ext.accelerator.setup import (
    accumulation_settings,
    dataloader_configuration,
    deepspeed_settings,
    fsdp_settings,
    launched_deepspeed_config,
    refuse_plugins,
    rng_types_for,
    strategy_settings,
)
from trainer_ext.accelerator.tracking import TrackingMixin
from trainer_ext.distributed.data.loader import skip_first_batches as _skip_first_batches
from trainer_ext.distributed.engine import Engine
from trainer_ext.distributed.rules import check_precision
from trainer_ext.distributed.state import DistributedType, DistState
from trainer_ext.distributed.strategies.deepspeed.plugin import (
    DeepSpeedPlugin,
    DummyOptim,
    DummyScheduler,
    SteppedByEngine,
)
from trainer_ext.distributed.strategies.fsdp.config import FSDPSettings
from trainer_ext.env_vars import MIXED_PRECISION as _ENV_PRECISION
from trainer_ext.errors import ConfigError
from trainer_ext.trackers import Tracker, resolve_trackers


class Accelerator(ProcessesMixin, CheckpointsMixin, TrackingMixin):
    """Device placement, DDP/FSDP2/DeepSpeed, mixed precision, accumulation, collectives, checkpoints, trackers."""

    deepspeed_max_grad_norm: float = 1.0  # what a DeepSpeed config's gradient_clipping "auto" becomes

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: str | Tracker | list[str | Tracker] | None = None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[Any] | None = None,
        dynamo_backend: str | None = None,
        dynamo_plugin: Any = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
        *,
        scheduler_counts_optimizer_steps: bool = False,
        even_batches: bool | None = None,
        seed: int | None = None,
        timeout: timedelta | None = None,
        fsdp_config: str | os.PathLike | dict | FSDPSettings | None = None,
        deepspeed_config: str | os.PathLike | dict | None = None,
    ) -> None:
        refuse_plugins(locals())
        self.project_configuration = project_config if project_config is not None else ProjectConfiguration()
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(os.fspath(project_dir))
        self.dataloader_config = dataloader_configuration(dataloader_config, split_batches, even_batches)
        handlers = split_handlers(kwargs_handlers)
        self.ddp_handler = handlers.get(DistributedDataParallelKwargs)
        self.scaler_handler = handlers.get(GradScalerKwargs)
        self.init_handler = handlers.get(InitProcessGroupKwargs)
        self.autocast_handler = handlers.get(AutocastKwargs)
        self.profile_handler = handlers.get(ProfileKwargs)
        known = (
            DistributedDataParallelKwargs,
            GradScalerKwargs,
            InitProcessGroupKwargs,
            AutocastKwargs,
            ProfileKwargs,
        )
        for cls in handlers:
            if cls not in known:
                raise ConfigError(
                    f"Unsupported kwargs handler passed: {cls.__name__}; kwargs_handlers takes "
                    f"{', '.join(k.__name__ for k in known)}"
                )
        init = self.init_handler.to_kwargs() if self.init_handler is not None else {}
        if init.get("init_method") is not None:
            warnings.warn(
                "InitProcessGroupKwargs(init_method=...) is not used: the process group starts from the launcher's "
                "environment (MASTER_ADDR/MASTER_PORT)",
                stacklevel=2,
            )
        state = DistState(cpu=cpu, timeout=init.get("timeout", timeout), backend=init.get("backend"))
        mode = str(mixed_precision or os.environ.get(_ENV_PRECISION) or "no")
        check_precision(mode, state.device)
        fsdp_named = fsdp_config is not None or fsdp_plugin is not None
        if deepspeed_plugin is None and deepspeed_plugins is None and deepspeed_config is None:
            deepspeed_config = launched_deepspeed_config(fsdp_named)
        ds_config, ds_plugin = deepspeed_settings(deepspeed_plugin, deepspeed_plugins, deepspeed_config)
        fsdp, fsdp_view = fsdp_settings(fsdp_plugin, fsdp_config, ds_config is not None)
        strategy, options = strategy_settings(fsdp, ds_config, self.ddp_handler)
        config = self.dataloader_config
        self.rng_types = rng_types_for(rng_types)
        self.engine = Engine(
            state,
            mixed_precision=mode,
            seed=config.data_seed if config.data_seed is not None else seed,
            split_batches=config.split_batches,
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            use_seedable_sampler=config.use_seedable_sampler,
            rng_types=self.rng_types,
            strategy=strategy,
            strategy_options=options,
            device_placement=device_placement,
            torch_compile={"backend": str(dynamo_backend).lower()}
            if dynamo_backend not in (None, "no", "NO")
            else None,
            gradient_accumulation_plugin_kwargs=accumulation_settings(
                gradient_accumulation_steps, gradient_accumulation_plugin
            ),
            scaler_kwargs=self.scaler_handler.to_kwargs() if self.scaler_handler is not None else None,
            autocast_kwargs=self.autocast_handler.to_kwargs() if self.autocast_handler is not None else None,
        )
        state.deepspeed_plugin = ds_plugin
        state.fsdp_plugin = fsdp_view
        state.mixed_precision, state.strategy_type = mode, self.engine.distributed_type  # for print(state)
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.scheduler_counts_optimizer_steps = bool(scheduler_counts_optimizer_steps)
        self.step = 0  # micro-batches since the end of the last dataloader (accelerate's count)
        self.flag_tensor: torch.Tensor | None = None
        self._trackers_requested = resolve_trackers(log_with)
        self.trackers: list[Tracker] = []
        self._schedulers: list[PreparedScheduler] = []
        self._custom: list[Any] = []
        self._save_state_pre_hooks: OrderedDict[int, Any] = OrderedDict()  # a handle holds it by weak reference
        self._load_state_pre_hooks: OrderedDict[int, Any] = OrderedDict()

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
    gradient_state = property(lambda self: self.engine.gradient_state)
    optimizer_step_was_skipped = property(lambda self: self.engine.optimizer_step_was_skipped)
    project_dir = property(lambda self: self.project_configuration.project_dir)
    logging_dir = property(lambda self: self.project_configuration.logging_dir)
    save_iteration = property(lambda self: self.project_configuration.iteration)
    split_batches = property(lambda self: self.dataloader_config.split_batches)
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)
    is_fsdp2 = property(lambda self: self.distributed_type == DistributedType.FSDP)

    @property
    def distributed_type(self) -> DistributedType:
        return self.engine.distributed_type

    @property
    def multi_device(self) -> bool:
        """Several DDP processes on accelerator devices (accelerate's meaning: not CPU processes, not FSDP/DeepSpeed)."""
        return (
            self.use_distributed and self.device.type != "cpu" and self.distributed_type == DistributedType.MULTI_GPU
        )

    @property
    def should_save_model(self) -> bool:
        """accelerate's answer without a parallelism config: the local main process."""
        return self.is_local_main_process

    # accelerate's composable-parallelism surface (tensor/context/pipeline parallelism): not configured here
    parallelism_config = None
    torch_device_mesh = None

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None:
        """The DeepSpeed settings (``deepspeed_plugin=`` or ``deepspeed_config=``), None without DeepSpeed."""
        return self.state.deepspeed_plugin

    is_composable_parallelism_enabled = property(lambda self: self.is_fsdp2)

    @property
    def fp8_backend(self) -> str:
        """``"AO"`` (torchao float8 layers) under ``mixed_precision="fp8"``, else ``"NO"``."""
        return "AO" if self.mixed_precision == "fp8" else "NO"

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        """Applies to the dataloaders prepared after the change, as in accelerate."""
        self.dataloader_config.even_batches = bool(value)
        self.engine.even_batches = bool(value)

    @property
    def sync_gradients(self) -> bool:
        return self.engine.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state._set_sync_gradients(value)

    @property
    def gradient_accumulation_steps(self) -> int:
        return int(self.gradient_state.plugin_kwargs.get("num_steps") or 1)

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.plugin_kwargs["num_steps"] = int(steps)

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
        schedulers = [is_scheduler(o) or isinstance(o, DummyScheduler) for o in objects]
        rest = [o for o, is_scheduler in zip(objects, schedulers, strict=True) if not is_scheduler]
        places = [p for p, is_scheduler in zip(placement, schedulers, strict=True) if not is_scheduler]
        self._take_loop_objects(objects, schedulers)
        self._resolve_auto_values(objects)
        prepared = self.engine.prepare(*rest, device_placement=places) if rest else ()
        remaining = iter((prepared,) if len(rest) == 1 else prepared)
        out = [self.prepare_scheduler(o) if s else next(remaining) for o, s in zip(objects, schedulers, strict=True)]
        if any(isinstance(o, DummyOptim) for o in out):
            raise ConfigError(
                "a DummyOptim is built by DeepSpeed together with its model: pass the model and the DummyOptim to the "
                "same prepare() call"
            )
        for obj in out:
            self._register_comm_hook(obj)
        return out[0] if len(out) == 1 else tuple(out)

    def _register_comm_hook(self, obj: Any) -> None:
        """``DistributedDataParallelKwargs(comm_hook=...)``: installed on each model DDP wrapped, as in accelerate."""
        ddp = isinstance(obj, torch.nn.parallel.DistributedDataParallel)
        if ddp and self.ddp_handler is not None and not getattr(obj, "_trainer_ext_comm_hook", False):
            self.ddp_handler.register_comm_hook(obj)
            obj._trainer_ext_comm_hook = True

    def _take_loop_objects(self, objects: tuple[Any, ...], schedulers: list[bool]) -> None:
        """Let the strategy check the optimizer and scheduler against its own (DeepSpeed's blocks, placeholders)."""
        optimizer = next((o for o in objects if isinstance(o, torch.optim.Optimizer | DummyOptim)), None)
        scheduler = next((o for o, s in zip(objects, schedulers, strict=True) if s), None)
        schedule = None
        if isinstance(scheduler, DummyScheduler):
            # accelerate's reading: the total was counted over the unsharded loader, once per process
            total = scheduler.total_num_steps
            if total is not None and not self.split_batches:
                total = math.ceil(total / self.num_processes)
            schedule = (total, scheduler.warmup_num_steps)
        self.engine.strategy.take_loop_objects(optimizer, scheduler, schedule)

    def _resolve_auto_values(self, objects: tuple[Any, ...]) -> None:
        """Let the strategy fill settings left to the loop (DeepSpeed's ``"auto"``) from what is being prepared."""
        loaders = [o for o in objects if isinstance(o, DataLoader)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer | DummyOptim)]
        defaults = {}
        if optimizers:
            first = optimizers[0]
            defaults = first.hyper_parameters() if isinstance(first, DummyOptim) else first.defaults
        self.engine.strategy.resolve_auto_values(
            micro_batch_size=(loaders[0].batch_size or 1) if loaders else 1,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            max_grad_norm=self.deepspeed_max_grad_norm,
            optimizer_defaults=defaults,
            mixed_precision=self.mixed_precision,
        )

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ):
        if self.verify_device_map(model) and self.num_processes > 1 and not evaluation_mode:
            raise ConfigError(
                "You can't train a model that has been loaded with `device_map='auto'` in any distributed mode. "
                "Load it on one device per process (no device_map), or run it on one process"
            )
        prepared = self.engine.prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self._register_comm_hook(prepared)
        return prepared

    @staticmethod
    def verify_device_map(model: torch.nn.Module) -> bool:
        """Whether ``model`` (or a submodule) was spread over several devices by a device map (``hf_device_map``)."""
        return any(len(getattr(module, "hf_device_map", None) or {}) > 1 for module in model.modules())

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.engine.prepare_optimizer(optimizer)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> DataLoader:
        return self.engine.prepare_dataloader(data_loader, device_placement=device_placement)

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler | SteppedByEngine:
        if isinstance(scheduler, PreparedScheduler | SteppedByEngine):
            return scheduler
        if isinstance(scheduler, DummyScheduler):
            built = self.engine.strategy.backend_scheduler()
            if built is None:
                raise ConfigError(
                    "a DummyScheduler stands for the scheduler DeepSpeed builds with its engine: pass it to the same "
                    "prepare() call as the model and optimizer"
                )
            return SteppedByEngine(built)
        prepared = PreparedScheduler(scheduler, self, self.step_scheduler_with_optimizer)
        self._schedulers.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
        return _skip_first_batches(dataloader, num_batches)

    # -- the step -------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of ``loss / gradient_accumulation_steps`` (accelerate's convention for ``accumulate``)."""
        steps = self.gradient_accumulation_steps
        self.engine.backward(loss if steps == 1 else loss / steps, **kwargs)  # x / 1 is x: one op less per step

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Backward and update in one for LOMO/AdaLomo optimizers (``lomo-optim``)."""
        if learning_rate is None:
            raise ConfigError("A learning rate must be passed in order to call backward pass with LOMO optimizers.")
        if not any(hasattr(o.optimizer, "fused_backward") for o in self.engine.prepared_optimizers):
            raise ConfigError(
                "Backward pass not properly called on LOMO optimizers. Are you sure you passed a LOMO optimizer in "
                "accelerator.prepare()?"
            )
        self.engine.backward(loss, learning_rate=learning_rate)

    def _do_sync(self) -> None:
        """accelerate's rule: the last batch of a loader syncs and restarts the count; otherwise every N-th does."""
        plugin = self.gradient_state.plugin_kwargs
        if plugin.get("sync_with_dataloader", True) and self.gradient_state.end_of_dataloader:
            self.step = 0
            self.gradient_state._set_sync_gradients(True)
        else:
            self.step += 1
            self.gradient_state._set_sync_gradients(self.step % self.gradient_accumulation_steps == 0)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-batch: gradients sync (and optimizers/schedulers step) every N-th, and at the end of data."""
        self._do_sync()
        if self.sync_gradients or not models:
            yield
            return
        sync_each_batch = self.use_distributed and self.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        with contextlib.ExitStack() as stack:
            if not sync_each_batch:
                for model in models:
                    stack.enter_context(self.engine.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        return self.engine.no_sync(model)

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
        """Make the next backward of a DDP model all-reduce its gradients after forwards run under ``no_sync``."""
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            yield
            return
        saved = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = saved

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager[Any]:
        """Autocast in the mixed-precision mode; ``autocast_handler`` changes ``enabled``/``cache_enabled`` here."""
        if autocast_handler is None:
            return self.engine.autocast()
        # the handler replaces the accelerator's own for this block (torch.autocast's defaults, then its values)
        return self.engine.autocast(**{"enabled": True, "cache_enabled": None, **autocast_handler.to_kwargs()})

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[torch.profiler.profile]:
        """``torch.profiler`` around the block; with ``output_trace_dir`` each process writes its Chrome trace."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is not None:
            handler.export_trace(profiler, self.process_index)
            self.wait_for_everyone()

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

    # -- collectives ----------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        return self.engine.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        return self.engine.gather_for_metrics(input_data, use_gather_object=use_gather_object)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return self.engine.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return self.engine.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

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
