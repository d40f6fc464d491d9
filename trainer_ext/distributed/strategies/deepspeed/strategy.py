"""DeepSpeed ZeRO 0-3 (with CPU/NVMe offload) through ``deepspeed.initialize``.

DeepSpeed wraps model, optimizer and scheduler together into one engine, and owns fp16 loss scaling,
gradient clipping (``gradient_clipping``) and accumulation boundaries (``gradient_accumulation_steps``):
call :meth:`DeepSpeedStrategy.backward` then :meth:`DeepSpeedStrategy.step` on every micro-batch and the
engine steps optimizer and scheduler at the boundary itself. Under our engine it takes the step over whole:
its precision does nothing (the engine casts and scales), ``backward`` steps at our sync boundary and the prepared
optimizer's ``step``/``zero_grad`` never act. deepspeed is imported only when used.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from trainer_ext.checkpointing import sharded as sharded_checkpoint
from trainer_ext.checkpointing.saving import save_model
from trainer_ext.distributed.precision import Precision
from trainer_ext.distributed.state import DistributedType, DistState
from trainer_ext.distributed.strategies.base import Strategy
from trainer_ext.distributed.strategies.deepspeed import config as deepspeed_config
from trainer_ext.distributed.strategies.deepspeed.arguments import config_from_training_args
from trainer_ext.distributed.strategies.deepspeed.config import DeepSpeedConfig, check_resolved
from trainer_ext.distributed.strategies.deepspeed.plugin import DummyOptim, DummyScheduler
from trainer_ext.distributed.strategies.deepspeed.setup import destroy_own_group, is_engine, start_communication
from trainer_ext.distributed.strategies.deepspeed.weights import (
    LATEST,
    ConsolidationError,
    check_complete,
    full_shape,
    saved_shapes,
)
from trainer_ext.errors import ConfigError

__all__ = ["ConsolidationError", "DeepSpeedStrategy", "check_complete", "saved_shapes"]  # imported from here


class DeepSpeedStrategy(Strategy):
    """Runs training through a DeepSpeed engine configured by a resolved DeepSpeed config dict.

    ``config`` must have no ``"auto"`` left (see ``trainer_ext.distributed.strategies.deepspeed.config``). Options:
    ``build_cpu_shm_comm`` (default False): let DeepSpeed compile its shared-memory all-reduce op on CPU,
    which only its tensor-parallel inference uses and which costs a minute of C++ compilation on first use.
    """

    name = "deepspeed"
    title = "DeepSpeed"
    option_names = ("config", "build_cpu_shm_comm")
    reshards_training_state = False  # its engine checkpoint loads only on the world size that wrote it

    def __init__(self, state: DistState, config: dict | DeepSpeedConfig, **options: Any) -> None:
        super().__init__(state, **options)
        self.hf_config = config if isinstance(config, DeepSpeedConfig) else DeepSpeedConfig(config)
        self.engine: Any = None
        self._grad_norm: torch.Tensor | None = None
        self._owns_group = False
        self._loop_steps: tuple[int | None, int | None] | None = None  # a loop's DummyScheduler: (total, warm-up)
        self._loop_scheduler: Any = None  # a loop's DummyScheduler(lr_scheduler_callable=...)

    @classmethod
    def read_training_arguments(cls, args: Any) -> DeepSpeedConfig:
        """``--deepspeed``: the config resolved from the arguments and registered with transformers."""
        return config_from_training_args(args)

    @property
    def config(self) -> dict:
        return self.hf_config.config

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.DEEPSPEED

    def setup_precision(
        self, mode: str, *, autocast_kwargs: dict[str, Any] | None = None, scaler_kwargs: dict[str, Any] | None = None
    ) -> Precision:
        """DeepSpeed casts the model, keeps fp32 masters and scales fp16 losses itself (its config's ``fp16``/
        ``bf16``): no autocast, ``forward`` patch or scaler of ours on top."""
        self.precision = Precision("no", self.state.device)
        return self.precision

    def resolve_auto_values(
        self,
        *,
        micro_batch_size: int,
        gradient_accumulation_steps: int,
        max_grad_norm: float,
        optimizer_defaults: dict[str, Any],
        mixed_precision: str,
    ) -> None:
        """Fill the config's ``"auto"`` values from a hand-written loop's loader and optimizer."""
        betas = optimizer_defaults.get("betas", (0.9, 0.999))
        self.hf_config.resolve(
            deepspeed_config.DeepSpeedInputs(
                world_size=self.state.num_processes,
                micro_batch_size=micro_batch_size,
                gradient_accumulation_steps=gradient_accumulation_steps,
                max_grad_norm=max_grad_norm,
                learning_rate=optimizer_defaults.get("lr", 1e-3),
                adam_beta1=betas[0],
                adam_beta2=betas[1],
                adam_epsilon=optimizer_defaults.get("eps", 1e-8),
                weight_decay=optimizer_defaults.get("weight_decay", 0.0),
                fp16=mixed_precision == "fp16",
                bf16=mixed_precision == "bf16",
                optimizer_must_match=False,  # a value the config writes out is the config's (accelerate's rule)
            )
        )

    def take_loop_objects(self, optimizer: Any, scheduler: Any, schedule: tuple[int | None, int] | None) -> None:
        """accelerate's rules for a loop's optimizer and scheduler against the config's blocks, with its words.

        A block is used through a placeholder (``DummyOptim``/``DummyScheduler``); a torch object and a block
        together would leave one unused. ``schedule`` (a DummyScheduler's total and warm-up steps) fills the
        scheduler block's ``"auto"`` values.
        """
        blocks = {name: name in self.config for name in ("optimizer", "scheduler")}
        fix = "remove the block from the DeepSpeed config, or pass"
        if optimizer is not None:
            if blocks["optimizer"] and not isinstance(optimizer, DummyOptim):
                raise ConfigError(
                    "You cannot specify an optimizer in the config file and in the code at the same time: "
                    f"{fix} trainer_ext.DummyOptim(params, lr=...) to use the block's optimizer"
                )
            if not blocks["optimizer"] and isinstance(optimizer, DummyOptim):
                raise ConfigError(
                    "You cannot create a `DummyOptim` without specifying an optimizer in the config file: add an "
                    "'optimizer' block to the DeepSpeed config, or pass a torch optimizer"
                )
        if scheduler is not None:
            if blocks["scheduler"] and not isinstance(scheduler, DummyScheduler):
                raise ConfigError(
                    "You cannot specify a scheduler in the config file and in the code at the same time: "
                    f"{fix} trainer_ext.DummyScheduler(optimizer, ...) to use the block's scheduler"
                )
            if not blocks["scheduler"] and isinstance(scheduler, DummyScheduler):
                if scheduler.lr_scheduler_callable is None:
                    raise ConfigError(
                        "Either specify a scheduler in the config file or pass in the `lr_scheduler_callable` "
                        "parameter when using `DummyScheduler`"
                    )
        if isinstance(optimizer, DummyOptim) and scheduler is not None and not isinstance(scheduler, DummyScheduler):
            raise ConfigError(
                "A `DummyOptim` stands for the config's optimizer, which the code's scheduler cannot be built on: pass "
                "`DummyScheduler(optimizer, lr_scheduler_callable=...)` to make the scheduler from DeepSpeed's optimizer"
            )
        if not isinstance(scheduler, DummyScheduler):
            return
        if scheduler.lr_scheduler_callable is not None and not blocks["scheduler"]:
            self._loop_scheduler = scheduler.lr_scheduler_callable
        elif schedule is not None:
            total, warmup = schedule
            auto = self.hf_config.is_auto
            self._loop_steps = (
                total if auto("scheduler.params.total_num_steps") else None,
                warmup if auto("scheduler.params.warmup_num_steps") else None,
            )

    def input_dtype(self) -> torch.dtype | None:
        """The engine's dtype once the config is resolved (before that the model is still in float32)."""
        if self.hf_config.is_auto("fp16.enabled") or self.hf_config.is_auto("bf16.enabled"):
            return None
        return self.hf_config.dtype()

    def backend_scheduler(self) -> Any:
        return getattr(self.engine, "lr_scheduler", None)

    # -- DeepSpeed's communication on our process group -------------------------------------------
    def deepspeed_module(self) -> Any:
        """The deepspeed module with its communication set up on our process group (idempotent)."""
        deepspeed, created_group = start_communication(self.state, self.options.get("build_cpu_shm_comm", False))
        self._owns_group = self._owns_group or created_group
        return deepspeed

    def register_with_transformers(self) -> None:
        """Let transformers see this config (``is_deepspeed_zero3_enabled``): ``from_pretrained`` then
        builds ZeRO-3 models partitioned. DeepSpeed communication, which ``zero.Init`` reads the world size
        from, starts on transformers' first ZeRO-3 query, not here."""
        # the hook holds the process state, not this strategy: the registration must not keep the config alive
        hook = functools.partial(start_communication, self.state, self.options.get("build_cpu_shm_comm", False))
        deepspeed_config.register_with_transformers(self.hf_config, on_first_zero3_query=hook)

    def unregister_from_transformers(self) -> None:
        deepspeed_config.unregister_from_transformers()

    def zero3_init_context(self) -> contextlib.AbstractContextManager[Any]:
        """Context that builds a model's parameters partitioned (ZeRO-3); a no-op for stages 0-2."""
        if not self.hf_config.is_zero3():
            return contextlib.nullcontext()
        return self.deepspeed_module().zero.Init(config_dict_or_path=self.config)

    # -- wrapping ---------------------------------------------------------------------------------
    def initialize(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Callable | None = None,
        lr_scheduler: Any = None,
        config: dict | None = None,
        params: Iterable[Any] | None = None,
    ) -> tuple[Any, Any, Any]:
        """``deepspeed.initialize`` on our process group; returns ``(engine, optimizer, scheduler)``.

        Without ``optimizer``/``lr_scheduler`` the config's ``optimizer``/``scheduler`` blocks are used;
        giving both an object and a block is refused (one would be ignored). ``lr_scheduler`` may be a
        callable taking the optimizer (for a scheduler on a config-built optimizer). The engine steps
        the scheduler at each boundary: callers must not step it again. ``config`` replaces the strategy's own
        for this engine (the evaluation engine of :meth:`wrap`). ``params`` (parameters or groups) are what a
        config-built optimizer trains (default: every parameter that requires a gradient).
        """
        config = dict(self.config if config is None else config)
        check_resolved(config)
        for given, block in ((optimizer, "optimizer"), (lr_scheduler, "scheduler")):
            if given is not None and block in config:
                raise ConfigError(
                    f"a {block} was passed and the DeepSpeed config has a '{block}' block too; remove the block "
                    f"to use the Trainer's {block}, or pass none to use the config's"
                )
        if optimizer is not None and self.hf_config.stage > 0:
            # a torch optimizer is what our Trainer passes; DeepSpeed asks for an explicit opt-in
            config.setdefault("zero_allow_untested_optimizer", True)
            if self.hf_config.get_value("zero_optimization.offload_optimizer.device") in ("cpu", "nvme"):
                # without DeepSpeedCPUAdam (a compiled op) the torch optimizer steps the offloaded state
                config.setdefault("zero_force_ds_cpu_optimizer", False)
        deepspeed = self.deepspeed_module()
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=params if optimizer is None and "optimizer" in config else None,
            lr_scheduler=lr_scheduler,
            config=config,
            dist_init_required=False,
        )
        self.engine = engine
        self._grad_norm = None
        return engine, ds_optimizer, ds_scheduler

    def setup_module_and_optimizer(
        self, model: torch.nn.Module, optimizer: Any, training_steps: tuple[int, int] | None
    ) -> tuple[Any, Any]:
        """Fill the model- and schedule-derived ``"auto"`` values, then :meth:`initialize`; returns
        ``(engine, optimizer)``. An ``optimizer`` block in the config wins over ``optimizer`` (left unused); a
        loop's ``DummyOptim`` gives the block its parameters (see :meth:`take_loop_objects`)."""
        steps, warmup = training_steps or self._loop_steps or (None, None)
        self.hf_config.finalize(
            hidden_size=deepspeed_config.model_hidden_size(model), num_training_steps=steps, num_warmup_steps=warmup
        )
        if isinstance(optimizer, DummyOptim):
            engine, ds_optimizer, _ = self.initialize(model, None, self._loop_scheduler, params=optimizer.params)
        else:
            engine, ds_optimizer, _ = self.initialize(model, None if "optimizer" in self.config else optimizer)
        return engine, ds_optimizer

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """An engine without optimizer (evaluation, ZeRO-3 inference); train through :meth:`initialize`.

        As transformers' ``deepspeed_init(inference=True)``: the config's optimizer and scheduler blocks are left
        out and the model-derived ``"auto"`` values filled from the model, on a copy (training still finalizes
        the config itself), so evaluating before or without training works with the shipped presets.
        """
        if is_engine(model):
            return model
        inference = {key: value for key, value in self.config.items() if key not in ("optimizer", "scheduler")}
        inference = deepspeed_config.finalize(inference, hidden_size=deepspeed_config.model_hidden_size(model))
        return self.initialize(model, config=inference)[0]

    def setup_module_alone(
        self, model: torch.nn.Module, *, evaluation: bool, device: torch.device | None
    ) -> torch.nn.Module:
        """A model without its optimizer: an evaluation engine (:meth:`wrap`), except for evaluation below ZeRO-3,
        where the model is only placed (ZeRO-3 partitions the parameters: even evaluation runs inside an engine)."""
        if evaluation and not self.hf_config.is_zero3():
            return model.to(device) if device is not None else model
        return self.wrap(model)

    def is_prepared(self, model: Any) -> bool:
        return is_engine(model)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        while is_engine(model):
            model = model.module
        return super().unwrap(model)

    def forget(self) -> None:
        self.engine = None
        self._grad_norm = None

    def _engine(self, engine: Any = None) -> Any:
        engine = engine if engine is not None else self.engine
        if engine is None:
            raise RuntimeError("DeepSpeedStrategy: call initialize(model, optimizer, scheduler) first")
        return engine

    # -- the step ---------------------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """DeepSpeed reduces at its own boundaries (ZeRO-2/3 refuse ``engine.no_sync``)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, sync: bool | None = None, **kwargs: Any) -> bool | None:
        """Backward through the engine (fp16 loss scaling is DeepSpeed's); with ``sync`` (the engine's call) the step
        follows at once, at that accumulation boundary rather than DeepSpeed's count, so a shorter last window steps
        too. Returns, at a boundary, whether DeepSpeed skipped the step (fp16 overflow); else None. Without ``sync``
        (an engine driven by hand) only the backward runs: call :meth:`step` after.

        Like every strategy, the loss is used as given: accumulation normalisation is the caller's, so
        DeepSpeed's own division by the accumulation steps is off unless ``scale_wrt_gas=True`` is passed.
        """
        kwargs.setdefault("scale_wrt_gas", False)
        engine = self._engine()
        if sync is None:
            engine.backward(loss, **kwargs)
            return None
        engine.set_gradient_accumulation_boundary(sync)
        before = getattr(engine, "skipped_steps", 0)
        engine.backward(loss, **kwargs)
        self.step()
        return getattr(engine, "skipped_steps", 0) > before if sync else None

    def should_step(self, sync: bool) -> bool:
        """Never: :meth:`backward` stepped (and zeroed the gradients) at the boundary already."""
        return False

    def step(self) -> None:
        """``engine.step()`` after every micro-batch; at the boundary it clips, steps the optimizer and
        the scheduler, and zeroes the gradients."""
        engine = self._engine()
        boundary = engine.is_gradient_accumulation_boundary()
        own_norm = boundary and not _engine_reports_norm(engine)
        if own_norm:
            # stage 0 in fp32 clips with torch and throws the norm away: measure it first
            # (the gradients are already all-reduced by the boundary backward)
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        engine.step()
        if own_norm:
            self._grad_norm = norm.detach()
        elif boundary:
            value = engine.get_global_grad_norm()
            self._grad_norm = None if value is None else torch.as_tensor(float(value))

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """The global gradient norm of the latest optimizer step (before clipping), or None before the first.

        DeepSpeed clips inside :meth:`step` at ``gradient_clipping``; a different ``max_norm`` is refused.
        """
        configured = float(self.config.get("gradient_clipping", 0.0) or 0.0)
        if max_norm and max_norm > 0 and not _close(max_norm, configured):
            raise ConfigError(
                f"clip_grad_norm_(max_norm={max_norm}) but DeepSpeed clips at gradient_clipping={configured}; "
                "set gradient_clipping in the DeepSpeed config (or 'auto' to take --max_grad_norm)"
            )
        if norm_type != 2.0:
            raise ConfigError(f"DeepSpeed clips by the 2-norm only; norm_type={norm_type} is not supported")
        return self._grad_norm

    # -- state dicts and checkpoints: DeepSpeed's own format (global_stepN/ + latest) ------------------------
    def shards_model(self, model: Any) -> bool:
        """A model inside an engine is checkpointed by the engine on every rank, in DeepSpeed's format."""
        return is_engine(model)

    def writes_own_checkpoint(self, model: Any) -> bool:
        """A model inside an engine: its checkpoints are the engine's (``global_stepN/`` + ``latest``)."""
        return is_engine(model)

    def writes_training_state(self, model: Any) -> bool:
        """``save_state`` writes the engine's checkpoint, which holds every model it trains."""
        return True

    def loads_whole_model_state(self) -> bool:
        """Only the engine's own checkpoints resume (model, optimizer and its state together)."""
        return False

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return self.consolidated_state_dict() or {}

    def export_model(
        self, model: torch.nn.Module, directory: str | os.PathLike, *, max_shard_size: str | int, is_main_process: bool
    ) -> None:
        """Gathered under ZeRO-3 on every rank (a collective), checked complete, written by the main process.
        A model with adapters (PEFT) writes its adapter only (only its tensors gathered)."""
        if self.export_adapter(model, directory, is_main_process=is_main_process):
            return
        state = self.consolidated_state_dict()
        if is_main_process:
            save_model(self.unwrap(model), directory, max_shard_size=max_shard_size, state_dict=state)

    def gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A ZeRO-3 partitioned parameter gathered from every rank (a collective); a whole one as it is."""
        if not hasattr(tensor, "ds_id"):
            return super().gather_tensor(tensor)
        with self.deepspeed_module().zero.GatheredParameters([tensor]):
            return tensor.data.detach().to("cpu").clone()

    def save_checkpoint_model(self, model: Any, directory: str | os.PathLike) -> None:
        """The engine's checkpoint: model, optimizer and scheduler in one (every rank)."""
        self.save_checkpoint(model, directory)

    def save_checkpoint_optimizer(self, model: Any, optimizer: Any, directory: str | os.PathLike) -> None:
        """Nothing: the engine's checkpoint (:meth:`save_checkpoint_model`) holds the optimizer."""

    @classmethod
    def has_own_checkpoint(cls, directory: str | os.PathLike) -> bool:
        return (Path(directory) / LATEST).is_file()

    @classmethod
    def check_own_checkpoint(cls, model: torch.nn.Module, directory: str | os.PathLike) -> None:
        """ConfigError when the checkpoint holds another model (parameter names or full shapes differ)."""
        found = saved_shapes(directory)
        if found is None:
            return
        params = list(model.named_parameters())
        expected = {name: list(full_shape(p)) for name, p in params}
        trainable = [name for name, p in params if p.requires_grad]  # frozen ones are saved only under some stages
        sharded_checkpoint.check_shapes(Path(directory).name, found[0], expected, must_have=trainable)

    def load_own_checkpoint(self, model: Any, directory: str | os.PathLike) -> None:
        self.load_checkpoint(model, directory)

    def save_training_state(self, directory: Path, models: list[Any], optimizers: list[Any]) -> bool:
        self.save_checkpoint(self.engine, directory / "deepspeed")
        return True

    def load_training_state(self, directory: Path, models: list[Any], optimizers: list[Any]) -> bool:
        self.load_checkpoint(self.engine, directory / "deepspeed")
        return True

    def save_checkpoint(
        self, engine: Any, directory: str | os.PathLike, tag: str | None = None, client_state: dict | None = None
    ) -> Path:
        """Engine, optimizer and scheduler state, written by every rank (all ranks must call it)."""
        engine = self._engine(engine)
        directory = Path(directory)
        engine.save_checkpoint(str(directory), tag=tag, client_state=client_state or {})
        return directory

    def load_checkpoint(self, engine: Any, directory: str | os.PathLike, tag: str | None = None) -> dict:
        """Restore what :meth:`save_checkpoint` wrote (all ranks); returns its ``client_state``."""
        engine = self._engine(engine)
        directory = Path(directory)
        if tag is None and not (directory / LATEST).is_file():
            raise ConfigError(
                f"no DeepSpeed checkpoint in {directory}: it has no 'latest' file (pass the tag, e.g. 'global_step10')"
            )
        if tag is not None and not (directory / str(tag)).is_dir():
            raise ConfigError(f"no DeepSpeed checkpoint {tag!r} in {directory}")
        path, client_state = engine.load_checkpoint(
            str(directory), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise ConfigError(f"DeepSpeed could not load the checkpoint in {directory} (tag {tag or 'latest'})")
        return client_state or {}

    def consolidated_state_dict(self, engine: Any = None) -> dict[str, torch.Tensor] | None:
        """The full model state dict in the training dtype on the main process (None on the others).

        A collective under ZeRO-3 (every rank must call it): gathered layer by layer into CPU tensors,
        tied weights kept tied. Stages 0-2 hold the whole model on every rank: its own state dict. The
        result is checked against the model's parameters — every one present with its full size — so an
        empty or partial save cannot happen.
        """
        engine = self._engine(engine)
        module = engine.module
        if engine.zero_optimization_partition_weights():
            state_dict = engine._zero3_consolidated_16bit_state_dict()
        elif self.state.is_main_process:
            state_dict = module.state_dict()
        if not self.state.is_main_process:
            return None
        check_complete(module, state_dict)
        return state_dict

    # -- teardown ---------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Drop the engine; tear down the one-rank group :meth:`deepspeed_module` created, if any."""
        self.forget()
        if self._owns_group:
            destroy_own_group()
        self._owns_group = False


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


def _engine_reports_norm(engine: Any) -> bool:
    """DeepSpeed records the global norm except for stage 0 in fp32 (plain torch clipping)."""
    return bool(engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled())
