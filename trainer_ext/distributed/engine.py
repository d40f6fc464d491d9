"""The engine: the accelerator protocol object that transformers' Trainer (and hand-written loops) call.

It composes a :class:`DistState` (who/where), a :class:`Strategy` (how the model is set up and stepped, with the
:class:`Precision` it holds: autocast and scaler) and a :class:`GradientState` (sync boundaries). It never asks
which backend it runs, nor what the backend takes over: it calls the strategy's hooks.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainer_ext.distributed import collectives
from trainer_ext.distributed.accumulation import GradientState
from trainer_ext.distributed.data.loader import shard_dataloader
from trainer_ext.distributed.engine_names import AccelerateNames
from trainer_ext.distributed.mesh import cp_attention, cp_model
from trainer_ext.distributed.mesh import setup as mesh_setup
from trainer_ext.distributed.mesh.context_parallel import active as cp_active
from trainer_ext.distributed.mesh.context_parallel import context_parallel, resolve_backend
from trainer_ext.distributed.mesh.device_mesh import build_parallel_mesh
from trainer_ext.distributed.optimizer import EngineOptimizer, OptimizerPlaceholder
from trainer_ext.distributed.precision import Precision
from trainer_ext.distributed.state import DistributedType, DistState
from trainer_ext.distributed.strategies import Strategy, resolve_strategy
from trainer_ext.errors import ConfigError


class Engine(AccelerateNames):
    """Prepare models, optimizers and dataloaders; run backward, clipping and collectives."""

    def __init__(
        self,
        state: DistState,
        *,
        mixed_precision: str = "no",
        strategy: Strategy | str | None = None,
        strategy_options: dict[str, Any] | None = None,
        seed: int | None = None,
        split_batches: bool = False,
        dispatch_batches: bool | None = None,
        even_batches: bool = True,
        use_seedable_sampler: bool = True,
        rng_types: list[str] | None = None,
        device_placement: bool = True,
        torch_compile: dict[str, Any] | None = None,
        gradient_accumulation_plugin_kwargs: dict[str, Any] | None = None,
        scaler_kwargs: dict[str, Any] | None = None,
        autocast_kwargs: dict[str, Any] | None = None,
        parallelism_config: Any = None,
    ) -> None:
        self.state = state
        config = mesh_setup.as_parallelism_config(parallelism_config)
        mesh_setup.check_parallelism(config, state.num_processes)
        if not isinstance(strategy, Strategy):
            options = {"mixed_precision": mixed_precision, **(strategy_options or {})}
            strategy = resolve_strategy(state, strategy, parallelism=config, **options)
        self.strategy = strategy
        # accelerate's names: the configuration (its sizes are what transformers' Trainer reads) and the N-D mesh
        self.parallelism_config = config
        self.parallel_mesh = None
        # the context-parallel attention this device runs (None without cp): torch's ring attention or ours
        self.cp_backend = (
            resolve_backend(config.cp_backend, state.device.type) if config and config.cp_enabled else None
        )
        if config is not None:
            self.parallel_mesh = build_parallel_mesh(config, state.device.type, state.num_processes)
            config.device_mesh = None if self.parallel_mesh is None else self.parallel_mesh.mesh
            strategy.use_mesh(self.parallel_mesh, config)
        self._mixed_precision = mixed_precision
        strategy.setup_precision(mixed_precision, autocast_kwargs=autocast_kwargs, scaler_kwargs=scaler_kwargs)
        self.gradient_state = GradientState(plugin_kwargs=gradient_accumulation_plugin_kwargs)
        self.seed = seed
        # accelerate's dataloader options, read by transformers and users as accelerator attributes;
        # dispatch_batches None means "dispatch iterable datasets only", as in accelerate
        self.split_batches = bool(split_batches)
        self.dispatch_batches = dispatch_batches
        self.even_batches = bool(even_batches)
        self.use_seedable_sampler = use_seedable_sampler
        self.rng_types = ["generator"] if rng_types is None else list(rng_types)  # synchronised at each pass start
        self.device_placement = device_placement
        self.torch_compile = torch_compile
        self.training_steps: tuple[int, int] | None = None  # (total, warm-up) for a schedule the backend builds
        self.step_was_skipped = False
        self.skipped_steps = 0  # optimizer steps skipped by the fp16 loss scaler (inf/NaN gradients)
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[EngineOptimizer] = []
        self._dataloaders: list[DataLoader] = []

    # -- topology, forwarded from the state -----------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def torch_device_mesh(self) -> Any:
        """accelerate's name for the N-D ``DeviceMesh`` of the ``parallelism_config`` (None without one)."""
        return None if self.parallel_mesh is None else self.parallel_mesh.mesh

    @property
    def same_batch_size(self) -> int:
        """Ranks that see the same batch (tensor-parallel ranks of one group; 1 without a parallelism config)."""
        return 1 if self.parallelism_config is None else self.parallelism_config.non_data_parallel_size

    @property
    def num_data_parallel_processes(self) -> int:
        """The ranks that see different batches: the processes over :attr:`same_batch_size`."""
        return self.state.num_processes // self.same_batch_size

    @property
    def data_parallel_index(self) -> int:
        """This rank's position among the data-parallel ranks (the mesh keeps same-batch ranks neighbours)."""
        return self.state.process_index // self.same_batch_size

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def distributed_type(self) -> DistributedType:
        return self.strategy.distributed_type

    @property
    def mixed_precision(self) -> str:
        return self._mixed_precision

    @property
    def precision(self) -> Precision:
        """The strategy's precision: autocast, the fp16 scaler and the ``forward`` patch."""
        return self.strategy.precision

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    @property
    def gradient_accumulation_steps(self) -> int:
        """accelerate's name: the accumulation the engine applies itself (1 under the Trainer, which accumulates)."""
        return int(self.gradient_state.plugin_kwargs.get("num_steps") or self.gradient_state.num_steps)

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped by the fp16 scaler (inf/NaN gradients)."""
        return self.step_was_skipped

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.state.local_main_process_first()

    # -- prepare --------------------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare each object by kind; same arity back (one object → bare, several → tuple).

        Models go first whatever the order given: sharding replaces their parameters, and the optimizers
        prepared with them are pointed at the replacements.
        """
        placement = device_placement or [self.device_placement] * len(objects)
        out: list[Any] = list(objects)
        self._prepare_together(out)
        for i, (obj, place) in enumerate(zip(out, placement, strict=True)):
            if isinstance(obj, torch.nn.Module):
                out[i] = self.prepare_model(obj, device_placement=place)
        for i, obj in enumerate(out):
            if isinstance(obj, torch.optim.Optimizer):
                out[i] = self.prepare_optimizer(obj)
        for i, (obj, place) in enumerate(zip(out, placement, strict=True)):
            if isinstance(obj, DataLoader):
                out[i] = self.prepare_dataloader(obj, device_placement=place)
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_together(self, objects: list[Any]) -> None:
        """Offer the first model and optimizer to the strategy to set up together (in place in ``objects``); one
        that sets them up separately leaves them to :meth:`prepare_model` and :meth:`prepare_optimizer`."""
        models = [
            i for i, o in enumerate(objects) if isinstance(o, torch.nn.Module) and not self.strategy.is_prepared(o)
        ]
        optimizers = [i for i, o in enumerate(objects) if isinstance(o, torch.optim.Optimizer | OptimizerPlaceholder)]
        if not models or not optimizers:
            return  # a model alone is wrapped by prepare_model (evaluation); an optimizer alone waits
        m, o = models[0], optimizers[0]
        optimizer = getattr(objects[o], "optimizer", objects[o])
        together = self.strategy.setup_module_and_optimizer(objects[m], optimizer, self.training_steps)
        if together is None:
            return
        model, backend_optimizer = together
        objects[m] = model
        wrapped = EngineOptimizer(backend_optimizer, self)
        self._optimizers.append(wrapped)
        objects[o] = wrapped
        self._models.append(model)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Place on the device, autocast ``forward``, wrap for training (not for evaluation), compile.

        Optimizers prepared earlier (another ``prepare`` call) are pointed at the parameters the wrapper trains.
        """
        if self.strategy.is_prepared(model):
            return model
        device = None if device_placement is False else self.device
        alone = self.strategy.setup_module_alone(model, evaluation=evaluation_mode, device=device)
        if alone is not None:  # the backend's own object for it (one that sets models up with their optimizer)
            self._models.append(alone)
            return alone
        if device_placement is None:
            device_placement = self.device_placement
        if device_placement and not _placed_by_user(model):
            model = model.to(self.device)
        inner = self.strategy.unwrap(model)
        if self.cp_backend is not None:  # refused before any step when cp would train it wrongly
            cp_model.check_model(inner, self.parallelism_config.cp_size)
            cp_attention.adopt(inner)
        if not evaluation_mode:
            self.precision.prepare_for_training(inner)
        self.precision.patch_forward(inner)
        if self.torch_compile and not getattr(inner, "_trainer_ext_compiled", False):
            # compile in place (same object) so that wrapping, no_sync and unwrapping see the user's module
            inner.compile(**self.torch_compile)
            inner._trainer_ext_compiled = True
        if not evaluation_mode:
            model = self.strategy.wrap(model)
        self._models.append(model)
        for optimizer in self._optimizers:
            self.strategy.adopt_optimizer(optimizer.optimizer)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> EngineOptimizer:
        if isinstance(optimizer, EngineOptimizer):
            return optimizer
        self.strategy.adopt_optimizer(optimizer)
        wrapped = EngineOptimizer(optimizer, self)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_dataloader(self, dataloader: DataLoader, device_placement: bool | None = None) -> DataLoader:
        """Shard ``dataloader`` over the processes; its batches move to our device unless placement is off.

        ``split_batches``, ``dispatch_batches`` and ``even_batches`` mean what they mean to accelerate (see
        :func:`~trainer_ext.distributed.data.loader.shard_dataloader`); they are read at each call, so setting one between
        two ``prepare`` calls applies to the loaders prepared after.
        """
        place = self.device_placement if device_placement is None else device_placement
        seed = self.seed if self.seed is not None else torch.random.initial_seed()
        dispatch = self.dispatch_batches
        if self.same_batch_size > 1:
            if dispatch:
                raise ConfigError(
                    "dispatch_batches=True sends each batch from the main process alone, and this parallelism_config "
                    "has ranks that read the same batches (tensor or context parallelism): set dispatch_batches=False"
                )
            dispatch = False  # every rank reads its data-parallel share of an iterable dataset
        loader = shard_dataloader(
            dataloader,
            num_processes=self.num_data_parallel_processes,
            process_index=self.data_parallel_index,
            gradient_state=self.gradient_state,
            seed=seed,
            device=self.device if place else None,
            split_batches=self.split_batches,
            dispatch_batches=dispatch,
            even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler,
            rng_types=self.rng_types,
            comm_device=self.device,
        )
        self._dataloaders.append(loader)
        return loader

    # -- the step -------------------------------------------------------------------------------
    def autocast(self, **overrides: Any) -> contextlib.AbstractContextManager[Any]:
        return self.precision.autocast(**overrides)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Skip the gradient all-reduce inside the block (non-final micro-batches of a window)."""
        return self.strategy.no_sync(model)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of ``loss`` as given: accumulation normalisation is the caller's (never divided here)."""
        learning_rate = kwargs.pop("learning_rate", None)
        kwargs.pop("scale_wrt_gas", None)
        if learning_rate is not None:
            lomo = [o.optimizer for o in self._optimizers if hasattr(o.optimizer, "fused_backward")]
            if lomo:
                lomo[0].fused_backward(loss, learning_rate)
                return
        skipped = self.strategy.backward(loss, sync=self.gradient_state.sync_gradients, **kwargs)
        if skipped is not None:  # the strategy stepped inside backward
            self.record_step(skipped)

    def record_step(self, skipped: bool) -> None:
        """Note an optimizer step, and whether the fp16 scaler skipped it (inf/NaN gradients)."""
        self.step_was_skipped = skipped
        self.skipped_steps += int(skipped)

    def unscale_gradients(self) -> None:
        for optimizer in self._optimizers:
            self.precision.unscale_(optimizer.optimizer)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Unscale fp16 gradients, then clip; returns the total norm before clipping."""
        self.unscale_gradients()
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """accelerate's context manager: under context parallelism, shard ``buffers`` in place along their sequence
        dimensions for this ``cp`` rank and run the block with context-parallel attention; a no-op without cp."""
        if self.cp_backend is None:
            return contextlib.nullcontext()
        return context_parallel(
            self.parallel_mesh["cp"], buffers, buffer_seq_dims, no_restore_buffers, backend=self.cp_backend
        )

    # -- models ---------------------------------------------------------------------------------
    def unwrap_model(self, model: torch.nn.Module, keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's module under DDP/DataParallel (never mutated); a user's ``torch.compile`` wrapper is
        kept when it directly wraps that module and ``keep_torch_compile`` is set."""
        if hasattr(model, "_orig_mod"):
            inner = self.strategy.unwrap(model._orig_mod)
            return model if keep_torch_compile and model._orig_mod is inner else inner
        return self.strategy.unwrap(model)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict; for a sharded model a collective that leaves it on the main process only."""
        if unwrap:
            model = self.unwrap_model(model, keep_torch_compile=False)
        return self.strategy.full_state_dict(model)

    def export_model(
        self,
        model: torch.nn.Module,
        directory: str | os.PathLike,
        max_shard_size: str | int = "10GB",
        writer: bool | None = None,
    ) -> None:
        """All ranks: the consolidated model as safetensors, written by the main process (the one save path), or by
        the processes for which ``writer`` is True (one per node under ``save_on_each_node``)."""
        writes = self.state.is_main_process if writer is None else writer
        self.strategy.export_model(model, directory, max_shard_size=max_shard_size, is_main_process=writes)

    # -- what has been prepared (in preparation order) ---------------------------------------------
    @property
    def prepared_models(self) -> list[torch.nn.Module]:
        return list(self._models)

    @property
    def prepared_optimizers(self) -> list[EngineOptimizer]:
        return list(self._optimizers)

    @property
    def prepared_dataloaders(self) -> list[DataLoader]:
        return list(self._dataloaders)

    # -- collectives ----------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        return collectives.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather from the data-parallel ranks (one of each group that saw the same batch; every rank of a cp group
        inside its split, where each holds a slice), then drop the duplicated samples that completed the loader's
        last round."""
        state = self.gradient_state
        cut = state.remainder if state.end_of_dataloader and state.remainder > 0 else None
        every = self.same_batch_size
        if cp_active() is not None:  # inside the split each cp rank holds a slice: gather all of them
            every //= self.parallelism_config.cp_size
        if use_gather_object or not _has_tensor(input_data):
            data = collectives.gather_object(input_data, every=every)
            return data[:cut] if cut is not None and isinstance(data, list) else data
        data = collectives.gather(input_data, every=every)
        return collectives.truncate_rows(data, cut) if cut is not None else data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return collectives.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return collectives.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    # -- lifecycle ------------------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> tuple[Any, ...]:
        """Forget prepared objects (the Trainer calls this before each train/HPO trial)."""
        held = bool(self._models or self._optimizers or self._dataloaders or objects)
        self._models.clear()
        self._optimizers.clear()
        self._dataloaders.clear()
        self.strategy.forget()
        if held:  # a full collection costs ~0.2 s on a large heap: only pay it when something was released
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return tuple(None for _ in objects)

    def end_training(self) -> None:
        """Release the backend, then tear down the process group this job created."""
        self.strategy.destroy()
        self.state.destroy()


def _placed_by_user(model: torch.nn.Module) -> bool:
    """A model spread over several devices by ``device_map``, or quantized, must not be moved."""
    device_map = getattr(model, "hf_device_map", None) or {}
    if len(set(device_map.values())) > 1:
        return True
    return bool(getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False))


def _has_tensor(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, dict):
        return any(_has_tensor(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(_has_tensor(v) for v in data)
    return False
