"""``Accelerator``: the Trainer's engine for hand-written loops, under accelerate's names and meaning.

Migrating a loop is one import: ``from trainer_ext import Accelerator`` (and ``ProjectConfiguration``,
``DataLoaderConfiguration`` and the kwargs handlers from ``trainer_ext`` instead of ``accelerate.utils``). What
such a script observes is accelerate's behaviour, including how a prepared LR scheduler steps; trainer_ext's own
choices are opt-in (``scheduler_counts_optimizer_steps=True``, ``fsdp_config=``, ``deepspeed_config=``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from trainer_ext.accelerator.checkpoints import StateCheckpoints, unwrap_module
from trainer_ext.accelerator.options import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
)
from trainer_ext.accelerator.preparing import (
    prepared_scheduler,
    refuse_device_map,
    refuse_lone_dummy_optim,
    register_comm_hook,
    schedulers_among,
    show_loop_objects,
    spread_by_device_map,
)
from trainer_ext.accelerator.processes import join_uneven_inputs, mesh_rank, runs_on
from trainer_ext.accelerator.scheduler import PreparedScheduler
from trainer_ext.accelerator.setup import (
    build_engine,
    dataloader_configuration,
    known_handlers,
    refuse_plugins,
    rng_types_for,
)
from trainer_ext.accelerator.step import check_lomo, count_micro_batch, profiled, trigger_sync_in_backward, unscale
from trainer_ext.accelerator.tracking import Trackers
from trainer_ext.distributed.data.loader import skip_first_batches as _skip_first_batches
from trainer_ext.distributed.state import DistributedType
from trainer_ext.distributed.strategies.deepspeed.plugin import (
    SteppedByEngine,
)
from trainer_ext.distributed.strategies.fsdp.config import FSDPSettings
from trainer_ext.trackers import Tracker


class Accelerator:
    """Device placement, DDP/FSDP2/DeepSpeed, mixed precision, accumulation, collectives, checkpoints, trackers.

    It holds an :class:`Engine` (the step, collectives, ``state``), a :class:`StateCheckpoints` (files) and
    :class:`Trackers`; each public name forwards to one of them. Where accelerate's own methods call another public
    method (``save_state`` and ``wait_for_everyone``, ``clear`` and ``free_memory``), ours do too, so a subclass's
    override takes part.
    """

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
        handlers = known_handlers(kwargs_handlers)
        self.ddp_handler = handlers.get(DistributedDataParallelKwargs)
        self.scaler_handler = handlers.get(GradScalerKwargs)
        self.init_handler = handlers.get(InitProcessGroupKwargs)
        self.autocast_handler = handlers.get(AutocastKwargs)
        self.profile_handler = handlers.get(ProfileKwargs)
        self.rng_types = rng_types_for(rng_types)
        self.engine = build_engine(locals(), handlers, self.dataloader_config, self.rng_types)
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.scheduler_counts_optimizer_steps = bool(scheduler_counts_optimizer_steps)
        self.step = 0  # micro-batches since the end of the last dataloader (accelerate's count)
        self.flag_tensor: torch.Tensor | None = None  # set_trigger's flag
        self._trackers = Trackers(log_with)
        self._checkpoints = StateCheckpoints(self)

    # -- who and where: the engine's DistState ---------------------------------------------------
    state = property(lambda self: self.engine.state)
    device = property(lambda self: self.engine.state.device)
    is_main_process = property(lambda self: self.engine.state.is_main_process)
    is_local_main_process = property(lambda self: self.engine.state.is_local_main_process)
    is_last_process = property(lambda self: self.engine.state.is_last_process)
    process_index = property(lambda self: self.engine.state.process_index)
    local_process_index = property(lambda self: self.engine.state.local_process_index)
    num_processes = property(lambda self: self.engine.state.num_processes)
    use_distributed = property(lambda self: self.engine.state.use_distributed)
    # -- the engine, the project and dataloader settings -----------------------------------------
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
    distributed_type = property(lambda self: self.engine.distributed_type)
    is_fsdp2 = property(lambda self: self.distributed_type == DistributedType.FSDP)
    deepspeed_plugin = property(lambda self: self.state.deepspeed_plugin)  # None without DeepSpeed

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

    # accelerate's composable-parallelism surface: the configuration and its N-D mesh (None without one)
    parallelism_config = property(lambda self: self.engine.parallelism_config)
    torch_device_mesh = property(lambda self: self.engine.torch_device_mesh)

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
        schedulers = schedulers_among(objects, placement)
        rest = [o for o, is_scheduler in zip(objects, schedulers, strict=True) if not is_scheduler]
        places = [p for p, is_scheduler in zip(placement, schedulers, strict=True) if not is_scheduler]
        show_loop_objects(
            self.engine,
            objects,
            schedulers,
            split_batches=self.split_batches,
            accumulation_steps=self.gradient_accumulation_steps,
            max_grad_norm=self.deepspeed_max_grad_norm,
        )
        prepared = self.engine.prepare(*rest, device_placement=places) if rest else ()
        remaining = iter((prepared,) if len(rest) == 1 else prepared)
        out = [self.prepare_scheduler(o) if s else next(remaining) for o, s in zip(objects, schedulers, strict=True)]
        refuse_lone_dummy_optim(out)
        for obj in out:
            register_comm_hook(self.ddp_handler, obj)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        refuse_device_map(self.verify_device_map(model), self.num_processes, evaluation_mode)
        prepared = self.engine.prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        register_comm_hook(self.ddp_handler, prepared)
        return prepared

    verify_device_map = staticmethod(spread_by_device_map)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.engine.prepare_optimizer(optimizer)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> DataLoader:
        return self.engine.prepare_dataloader(data_loader, device_placement=device_placement)

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler | SteppedByEngine:
        """Step ``scheduler`` by accelerate's rule (and include it in ``save_state``)."""
        prepared, new = prepared_scheduler(self.engine, scheduler, self, self.step_scheduler_with_optimizer)
        if new:
            self._checkpoints.schedulers.append(prepared)
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
        check_lomo(self.engine, learning_rate)
        self.engine.backward(loss, learning_rate=learning_rate)

    def _do_sync(self) -> None:
        self.step = count_micro_batch(self.gradient_state, self.step, self.gradient_accumulation_steps)

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
                    stack.enter_context(self.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        return self.engine.no_sync(model)

    trigger_sync_in_backward = staticmethod(trigger_sync_in_backward)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager[Any]:
        """Autocast in the mixed-precision mode; ``autocast_handler`` changes ``enabled``/``cache_enabled`` here."""
        if autocast_handler is None:
            return self.engine.autocast()
        # the handler replaces the accelerator's own for this block (torch.autocast's defaults, then its values)
        return self.engine.autocast(**{"enabled": True, "cache_enabled": None, **autocast_handler.to_kwargs()})

    def profile(self, profile_handler: ProfileKwargs | None = None) -> contextlib.AbstractContextManager[Any]:
        """``torch.profiler`` around the block; with ``output_trace_dir`` each process writes its Chrome trace."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        return profiled(handler, self.process_index, self.wait_for_everyone)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.engine.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the fp16 gradients of ``optimizer`` (one, a list, or every prepared one) before reading them."""
        unscale(self.engine, optimizer)

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
        self._trackers.finish()
        self.engine.end_training()

    def free_memory(self, *objects: Any) -> tuple[Any, ...]:
        """Forget the prepared objects (and schedulers), release cached memory; ``objects`` come back as None."""
        self._checkpoints.schedulers.clear()
        self.step = 0
        return self.engine.free_memory(*objects)

    def clear(self, *objects: Any) -> tuple[Any, ...]:
        """accelerate's alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    # -- who runs what ---------------------------------------------------------------------------
    def on_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: run ``function`` on the main process only (``None`` elsewhere)."""
        return runs_on(self, lambda state: state.is_main_process, "on_main_process", function)

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: run ``function`` on the main process of each node only."""
        return runs_on(self, lambda state: state.is_local_main_process, "on_local_main_process", function)

    def on_last_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: run ``function`` on the last process only."""
        return runs_on(self, lambda state: state.is_last_process, "on_last_process", function)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        """Decorator: run ``function`` on process ``process_index`` only (``@accelerator.on_process(process_index=1)``)."""
        if function is None and isinstance(self, Accelerator):
            return functools.partial(self.on_process, process_index=process_index)
        return runs_on(self, lambda state: state.process_index == process_index, "on_process", function)

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Any:
        """Decorator: run ``function`` on local process ``local_process_index`` of each node only."""
        if function is None and isinstance(self, Accelerator):
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        decide = lambda state: state.local_process_index == local_process_index  # noqa: E731
        return runs_on(self, decide, "on_local_process", function)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        self.engine.print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """A barrier: every process waits here until all have reached it."""
        self.engine.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> contextlib.AbstractContextManager:
        """This process's contiguous share of a list, tuple, tensor, ``datasets.Dataset`` or dict of them
        (``apply_padding``: as many for every process, by repeating the last element)."""
        return self.engine.split_between_processes(inputs, apply_padding=apply_padding)

    def set_trigger(self) -> None:
        """Raise this process's flag; ``check_trigger`` on every process then returns True once."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called ``set_trigger`` since the last check (a collective)."""
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        if self.reduce(self.flag_tensor).item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    def join_uneven_inputs(
        self, joinables: list[Any], even_batches: bool | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Train or evaluate DDP models when processes get different numbers of batches (torch's ``Join``);
        ``even_batches`` overrides the accelerator's inside the block."""
        return join_uneven_inputs(self.engine, joinables, even_batches, self.even_batches)

    # ranks along parallel dimensions: the mesh's, or accelerate's answers where the dimension is not configured
    tensor_parallel_rank = mesh_rank("tensor_parallel_rank", "tp")
    pipeline_parallel_rank = mesh_rank("pipeline_parallel_rank", "pp")
    context_parallel_rank = mesh_rank("context_parallel_rank", "cp")
    data_parallel_rank = mesh_rank("data_parallel_rank", "dp_replicate")
    data_parallel_shard_rank = mesh_rank("data_parallel_shard_rank", "dp_shard")

    def maybe_context_parallel(
        self, buffers: Any = None, buffer_seq_dims: Any = None, no_restore_buffers: Any = None
    ) -> Any:
        """Under ``cp_size > 1``: shard ``buffers`` in place along ``buffer_seq_dims`` for this rank and run the block
        with context-parallel attention (buffers not in ``no_restore_buffers`` come back after); else a plain block."""
        return self.engine.maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers)

    # -- trackers --------------------------------------------------------------------------------
    @property
    def trackers(self) -> list[Tracker]:
        """The started trackers (on the main process, after ``init_trackers``)."""
        return self._trackers.started

    @trackers.setter
    def trackers(self, value: list[Tracker]) -> None:
        self._trackers.started = list(value)

    def init_trackers(
        self, project_name: str, config: dict[str, Any] | None = None, init_kwargs: dict[str, dict] | None = None
    ) -> None:
        """Start the trackers from ``log_with`` on the main process; store ``config`` as hyper-parameters."""
        if self.is_main_process:
            self._trackers.init(project_name, self.logging_dir, config, init_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker ``name`` (its backend object with ``unwrap``); where it does not run (other ranks,
        before ``init_trackers``, no ``log_with``) a blank tracker whose every call does nothing."""
        return self._trackers.get(name, unwrap)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, dict] | None = None) -> None:
        """Log to every started tracker (main process only); ``log_kwargs[name]`` goes to that tracker's call."""
        self._trackers.log(values, step, log_kwargs)

    # -- models and training state on disk ---------------------------------------------------------
    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's module; ``keep_fp32_wrapper=False`` also removes the autocast patch of ``forward``."""
        return unwrap_module(self.engine, model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        return self.engine.get_state_dict(model, unwrap=unwrap)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save ``obj`` from the main process only (each node's, under ``save_on_each_node``): ``torch.save``, or
        safetensors for a dict of tensors."""
        self._checkpoints.save(obj, f, safe_serialization)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: str | int = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the unwrapped model as safetensors (split above ``max_shard_size``) from the main process (each
        node's with ``save_on_each_node``); all ranks call it (a sharded model is gathered by its strategy)."""
        self._checkpoints.save_model(model, save_directory, max_shard_size, safe_serialization)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Extra objects with ``state_dict``/``load_state_dict`` to include in ``save_state``."""
        self._checkpoints.register_for_checkpointing(*objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs in ``save_state`` before anything is written; removing an entry
        of ``weights`` leaves that model to the hook. Returns a handle whose ``remove()`` unregisters it."""
        return self._checkpoints.register_save_state_pre_hook(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs in ``load_state`` before anything is read; removing a model from
        ``models`` leaves its loading to the hook."""
        return self._checkpoints.register_load_state_pre_hook(hook)

    def save_state(
        self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, **_: Any
    ) -> str:
        """All ranks: everything ``load_state`` restores, committed by a ``COMPLETE`` marker written last; without
        ``output_dir``, a folder under ``project_dir/checkpoints`` (``ProjectConfiguration`` names it)."""
        return self._checkpoints.save_state(output_dir, self.step, safe_serialization)

    def load_state(
        self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, **_: Any
    ) -> None:
        """All ranks, after ``prepare``: restore what ``save_state`` wrote (or accelerate's ``save_state``), including
        each loader's position; without ``input_dir``, the newest checkpoint under ``project_dir/checkpoints``."""
        step = self._checkpoints.load_state(input_dir)
        if step is not None:
            self.step = step
