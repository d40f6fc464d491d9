"""The strategy interface: how a model is wrapped, synchronised and unwrapped for one backend."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from trainer_ext.checkpointing.saving import has_adapters, save_adapter, save_model
from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.distributed.mesh.device_mesh import ParallelMesh
from trainer_ext.distributed.optimizer import OptimizerPlaceholder, SchedulerPlaceholder
from trainer_ext.distributed.precision import Precision
from trainer_ext.distributed.state import DistributedType, DistState
from trainer_ext.errors import ConfigError


class Strategy:
    """Base strategy: one process, nothing wrapped. Subclasses override what their backend changes.

    A strategy owns its whole backend: its precision, how models and optimizers are set up, gradient sync,
    backward and the optimizer step, clipping, state dicts, checkpoints of models no rank holds whole, the
    consolidated export and teardown. Generic code (engine, Trainer, Accelerator) calls these methods
    unconditionally; it never asks which backend it is, nor what the backend takes over.
    """

    name = "single"
    title = "one process"  # how messages name the backend
    option_names: tuple[str, ...] = ()  # the keyword options this strategy takes (others are dropped)
    # a checkpoint of another number of processes resumes (load_state, the Trainer's resume); not DeepSpeed's
    reshards_training_state = True
    # the processes it runs on, and what check_world says outside them ({world_size}: the processes there are)
    min_processes = 1
    max_processes: int | None = None
    too_few_processes = ""
    too_many_processes = ""
    # its collectives need a process group even on one process (FSDP2's device mesh): the launcher's rendezvous
    # makes one of world size 1, and a process started without a launcher makes its own (DistState)
    needs_process_group = False

    def __init__(self, state: DistState, **options: Any) -> None:
        self.state = state
        self.options = options
        self.precision = Precision("no", state.device)  # replaced by setup_precision (the engine calls it)
        self.parallel: ParallelMesh | None = None  # the engine's N-D mesh (use_mesh), None without one
        self.parallelism: ParallelismConfig | None = None

    @classmethod
    def from_options(cls, state: DistState, **options: Any) -> Strategy:
        """Build from a mixed bag of options (the engine passes all it knows): keep the ones this class takes."""
        return cls(state, **{k: v for k, v in options.items() if k in cls.option_names})

    @classmethod
    def check_world(cls, world_size: int) -> None:
        """ConfigError when this strategy cannot run on ``world_size`` processes (the message says what to do)."""
        if world_size < cls.min_processes:
            raise ConfigError(cls.too_few_processes.format(world_size=world_size))
        if cls.max_processes is not None and world_size > cls.max_processes:
            raise ConfigError(cls.too_many_processes.format(world_size=world_size))

    @classmethod
    def check_parallelism(cls, config: ParallelismConfig) -> None:
        """ConfigError when this backend cannot run ``config``'s layout: here, anything but data replication."""
        if config.splits_model:
            raise ConfigError(
                f"{cls.title} does not shard the model over a device mesh, and this parallelism_config asks for "
                f"dp_shard_size={config.dp_shard_size}, tp_size={config.tp_size}, cp_size={config.cp_size}"
                + (f", pp_size={config.pp_size}" if config.pp_enabled else "")
                + ": train with FSDP2 (the default for such a config; --fsdp), or set those sizes to 1"
            )

    def use_mesh(self, built: ParallelMesh | None, config: ParallelismConfig) -> None:
        """Take the engine's N-D mesh (None when no dimension is enabled) and its configuration."""
        self.parallel, self.parallelism = built, config

    @classmethod
    def read_training_arguments(cls, args: Any) -> Any:
        """What this backend makes of transformers' ``TrainingArguments`` that ask for it by their flag (its
        settings, checked and normalised on ``args``); None for a backend without a flag of its own."""
        return None

    @classmethod
    def claim_world(cls, state: DistState) -> None:
        """Check that this strategy runs on ``state``'s processes, and give it the process group it needs."""
        cls.check_world(state.num_processes)
        if cls.needs_process_group:
            state.join_process_group()

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap a model already on its device for training; the base strategy returns it as is."""
        return model

    def is_prepared(self, model: Any) -> bool:
        """True when ``model`` is already this backend's finished training object (nothing more to do to it)."""
        return False

    # -- precision ----------------------------------------------------------------------------------
    def setup_precision(
        self, mode: str, *, autocast_kwargs: dict[str, Any] | None = None, scaler_kwargs: dict[str, Any] | None = None
    ) -> Precision:
        """Build and keep this strategy's precision for ``mode``: autocast, the fp16 scaler (:meth:`make_grad_scaler`)
        and fp8 layers, applied by the engine around the models it prepares."""
        self.precision = Precision(
            mode,
            self.state.device,
            scaler_factory=self.make_grad_scaler,
            autocast_kwargs=autocast_kwargs,
            **(scaler_kwargs or {}),
        )
        return self.precision

    def make_grad_scaler(self, device_type: str, **kwargs: Any) -> torch.amp.GradScaler:
        """The fp16 loss scaler for this backend."""
        return torch.amp.GradScaler(device_type, **kwargs)

    # -- setting models and optimizers up -----------------------------------------------------------
    def setup_module_and_optimizer(
        self, model: torch.nn.Module, optimizer: Any, training_steps: tuple[int, int] | None
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer] | None:
        """Set a model and its optimizer up together, or None to leave each to its own preparation (here: the
        engine places and casts the model, wraps it (:meth:`wrap`), then points the optimizer at what it trains).
        ``training_steps`` is (total, warm-up) when known."""
        return None

    def setup_module_alone(
        self, model: torch.nn.Module, *, evaluation: bool, device: torch.device | None
    ) -> torch.nn.Module | None:
        """A model prepared without its optimizer (``evaluation``: not for training; ``device``: where to place it,
        None to leave it): this backend's object for it, or None to let the engine place, cast and wrap it."""
        return None

    def resolve_auto_values(
        self,
        *,
        micro_batch_size: int,
        gradient_accumulation_steps: int,
        max_grad_norm: float,
        optimizer_defaults: dict[str, Any],
        mixed_precision: str,
    ) -> None:
        """Fill backend settings left to the loop (a hand-written loop's batch size, optimizer …); none here."""

    def take_loop_objects(self, optimizer: Any, scheduler: Any, schedule: tuple[int | None, int] | None) -> None:
        """Check what a hand-written loop passes to ``prepare`` against this backend. accelerate's placeholders
        (``DummyOptim``/``DummyScheduler``) stand for a DeepSpeed config's blocks: refused here."""
        for obj in (optimizer, scheduler):
            if isinstance(obj, OptimizerPlaceholder | SchedulerPlaceholder):
                raise ConfigError(
                    f"{type(obj).__name__} stands for the optimizer or scheduler block of a DeepSpeed config, and this "
                    "Accelerator runs no DeepSpeed; pass deepspeed_config=... (or deepspeed_plugin=DeepSpeedPlugin(...)) "
                    "to the Accelerator, or prepare a torch optimizer and scheduler"
                )

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point an optimizer built before :meth:`wrap` at the parameters the wrapper trains (no-op here)."""

    def forget(self) -> None:
        """Drop what was remembered about prepared models (the engine's ``free_memory``)."""

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Strip this strategy's wrapper (and DataParallel) to reach the user's module."""
        while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        return model

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context in which backward does not synchronise gradients (non-final micro-batches)."""
        return contextlib.nullcontext()

    def after_failed_forward(self, model: torch.nn.Module) -> None:
        """Undo what a forward that raised (out of memory) left half done, so that the retry issues the same
        collectives as the ranks that did not fail. Nothing to undo by default."""

    # -- the step: a strategy may take backward and the optimizer step over whole ---------------------
    def backward(self, loss: torch.Tensor, *, sync: bool | None = None, **kwargs: Any) -> bool | None:
        """Backward of one micro-batch's ``loss``, scaled by this strategy's precision; ``sync`` is True at an
        accumulation boundary. Returns None when no optimizer step ran (here: :meth:`optimizer_step` runs it), or,
        for a backend that steps inside backward, whether that step was skipped (fp16 overflow)."""
        self.precision.scale(loss).backward(**kwargs)
        return None

    def should_step(self, sync: bool) -> bool:
        """Whether a prepared optimizer's ``step`` and ``zero_grad`` act now (``sync``: an accumulation boundary)."""
        return sync

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        """Step ``optimizer`` (through the precision's fp16 scaler unless a ``closure`` is given); True when the
        scaler skipped the step (inf/NaN gradients)."""
        if closure is not None:
            optimizer.step(closure)
            return False
        return self.precision.step(optimizer)

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """Clear ``optimizer``'s gradients (at a boundary, when :meth:`should_step`)."""
        optimizer.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def backend_scheduler(self) -> Any:
        """An LR scheduler the backend built and steps itself (from its own config), or None."""
        return None

    def input_dtype(self) -> torch.dtype | None:
        """The dtype float inputs must take to match the model the backend casts, or None to leave them."""
        return None

    # -- state dicts and checkpoints --------------------------------------------------------------
    def shards_model(self, model: Any) -> bool:
        """True when no rank holds ``model`` whole: its checkpoints are written by every rank, its export gathered."""
        return False

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict (a collective for sharded models; on the main process only then)."""
        return model.state_dict()

    def export_model(
        self, model: torch.nn.Module, directory: str | os.PathLike, *, max_shard_size: str | int, is_main_process: bool
    ) -> None:
        """Write the consolidated, unwrapped model as safetensors (sharded above ``max_shard_size``); all ranks call."""
        if is_main_process:
            save_model(self.unwrap(model), directory, max_shard_size=max_shard_size)

    def gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """One whole tensor of the model, detached, on the CPU (a collective where the backend shards it)."""
        return tensor.detach().to("cpu").contiguous()

    def export_adapter(self, model: torch.nn.Module, directory: str | os.PathLike, *, is_main_process: bool) -> bool:
        """A model with adapters (PEFT, transformers' ``add_adapter``): write its adapter only, each tensor gathered
        by :meth:`gather_tensor` (all ranks call), and return True; other models: False. The base is never gathered."""
        unwrapped = self.unwrap(model)
        if not has_adapters(unwrapped):
            return False
        save_adapter(unwrapped, directory, self.gather_tensor, is_main_process=is_main_process)
        return True

    def save_checkpoint_model(self, model: Any, directory: str | os.PathLike) -> None:
        """Sharded models (``shards_model``): every rank writes its part of ``model`` into a Trainer checkpoint."""
        raise NotImplementedError(f"strategy {self.name!r} holds whole models: the Trainer saves them itself")

    def save_checkpoint_optimizer(self, model: Any, optimizer: Any, directory: str | os.PathLike) -> None:
        """Sharded models: every rank writes its part of the optimizer state into a Trainer checkpoint."""
        raise NotImplementedError(f"strategy {self.name!r} holds whole models: the Trainer saves them itself")

    def writes_own_checkpoint(self, model: Any) -> bool:
        """True when checkpoints of ``model`` are in this backend's own format, which only it resumes."""
        return False

    def writes_training_state(self, model: Any) -> bool:
        """True when ``save_state`` leaves ``model``'s weights to :meth:`save_training_state` (its own files),
        out of reach of the whole-file writer and its hooks."""
        return self.shards_model(model)

    def loads_whole_model_state(self) -> bool:
        """True when a loop checkpoint of whole models (accelerate's, or ours without sharding) resumes here."""
        return True

    @classmethod
    def has_own_checkpoint(cls, directory: str | os.PathLike) -> bool:
        """True when ``directory`` holds a checkpoint in this backend's own format (only this backend resumes it)."""
        return False

    @classmethod
    def check_own_checkpoint(cls, model: torch.nn.Module, directory: str | os.PathLike) -> None:
        """ConfigError when a checkpoint in this backend's own format holds another model."""

    def load_own_checkpoint(self, model: Any, directory: str | os.PathLike) -> None:
        """Restore model, optimizer and scheduler from a checkpoint in this backend's own format (all ranks)."""
        raise NotImplementedError(f"strategy {self.name!r} has no checkpoint format of its own")

    def save_training_state(self, directory: Path, models: list[Any], optimizers: list[Any]) -> bool:
        """``save_state`` of a loop: write the models and optimizers this backend holds in its own way (every rank);
        False leaves them to the whole-file writer of the main process."""
        return False

    def load_training_state(self, directory: Path, models: list[Any], optimizers: list[Any]) -> bool:
        """``load_state``: restore what :meth:`save_training_state` wrote; False when the generic loader does it."""
        return False

    # -- teardown ---------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release what the backend holds (engines, groups it created); the engine calls it at the end."""
        self.forget()
