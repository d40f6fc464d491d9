"""``Trainer``: transformers' Trainer with our :class:`~trainer_ext.distributed.Engine` as ``self.accelerator``.

Everything else — the training loop, gradient accumulation, logging, checkpoints, resume — is
transformers' own code; the engine answers the calls it makes to its accelerator.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel
from transformers.utils import logging

from trainer_ext.callbacks import BarrierCallback, MainProcessLoggingCallback, UnwrapAndSaveCallback
from trainer_ext.callbacks.duties import DutyCallbackHandler
from trainer_ext.callbacks.run_summary import RunSummaryCallback
from trainer_ext.distributed.engine import Engine
from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.distributed.strategies.deepspeed.plugin import SteppedByEngine
from trainer_ext.errors import ConfigError
from trainer_ext.trainer import compat as _compat
from trainer_ext.trainer.auto_batch import AutoBatchMixin
from trainer_ext.trainer.checkpoints import CheckpointingMixin
from trainer_ext.trainer.context_parallel import ContextParallelMixin
from trainer_ext.trainer.exact_eval import ExactEvalLossMixin
from trainer_ext.trainer.foreign_accelerate import align_accelerate_state
from trainer_ext.trainer.lean_step import LeanStepMixin
from trainer_ext.trainer.pipeline import PipelineMixin
from trainer_ext.trainer.sharded import ShardedCheckpointMixin
from trainer_ext.trainer.training_args import STOCK_TRAINING_ARGUMENTS, TrainingArguments

logger = logging.get_logger(__name__)
_compat.check_transformers_version()


def _ddp_options(trainer: transformers.Trainer) -> dict[str, Any]:
    """DistributedDataParallel keyword arguments from the TrainingArguments (transformers' own rule)."""
    args = trainer.args
    if args.ddp_find_unused_parameters is not None:
        find_unused = args.ddp_find_unused_parameters
    elif isinstance(trainer.model, PreTrainedModel):
        # find_unused_parameters breaks activation checkpointing
        find_unused = not _compat.uses_activation_checkpointing(trainer.model, args)
    else:
        find_unused = True
    return {
        "find_unused_parameters": find_unused,
        "bucket_cap_mb": args.ddp_bucket_cap_mb,
        "broadcast_buffers": args.ddp_broadcast_buffers,
        "static_graph": args.ddp_static_graph,
    }


def _parallelism_of(args: Any, model: Any) -> Any:
    """The arguments' ``parallelism_config``; for a model transformers loaded tensor-parallel, its sizes (as
    transformers' own Trainer sets them): ``tp_size`` from the model, the data-parallel rest sharded."""
    config = args.parallelism_config
    tp_size = getattr(model, "tp_size", None) or 1
    if not isinstance(tp_size, int) or tp_size <= 1:
        return config
    distributed = getattr(getattr(model, "config", None), "distributed_config", None)
    dp_size = getattr(distributed, "dp_size", None) or args.world_size // tp_size
    if config is None:
        return ParallelismConfig(tp_size=tp_size, dp_shard_size=dp_size)
    config.tp_size, config.dp_shard_size = tp_size, dp_size
    return config


# accelerate's GradientAccumulationPlugin defaults: its plugin_kwargs list only the values that differ
_ACCUMULATION_DEFAULTS = {
    "num_steps": None,
    "adjust_scheduler": True,
    "sync_with_dataloader": True,
    "sync_each_batch": False,
}


def _foreign_arguments(args: Any) -> str:
    """What to do with arguments that are not ours: plain transformers ones, or another trainer's own class."""
    name = f"{type(args).__module__}.{type(args).__qualname__}"
    if type(args) is STOCK_TRAINING_ARGUMENTS or not isinstance(args, STOCK_TRAINING_ARGUMENTS):
        return (
            f"trainer_ext.Trainer needs trainer_ext.TrainingArguments, got {name}; replace "
            "`from transformers import TrainingArguments` with `from trainer_ext import TrainingArguments`"
        )
    return (
        f"trainer_ext.Trainer got {name}, the arguments of another trainer; run that trainer on trainer_ext's engine "
        f"with its own arguments unchanged: `trainer_ext.adapt(ItsTrainer)(args=...)` (e.g. "
        "`trainer_ext.adapt(trl.SFTTrainer)(model=..., args=SFTConfig(...))`)"
    )


def _log_mean_loss_head(model: str, args: TrainingArguments) -> None:
    """Say once, at start-up, that a forward taking ``num_items_in_batch`` without using it trains on its mean."""
    processes = args.world_size if args.average_tokens_across_devices else 1
    factor = processes * args.gradient_accumulation_steps
    line = f"{model} accepts num_items_in_batch but computes its loss as a per-micro-batch mean: trained and logged "
    line += "as that mean, equal to a 1-process run"
    if factor == 1:
        logger.info(line)
        return
    logger.warning(
        f"{line} (transformers' Trainer here: {factor}x the training loss and its gradients"
        + (f", {processes}x eval_loss)" if processes > 1 else ")")
    )


class Trainer(
    ExactEvalLossMixin,
    ContextParallelMixin,  # after exact eval: it reads the loss summed over the cp ranks
    PipelineMixin,  # after exact eval too; under pipeline parallelism its steps replace those below
    AutoBatchMixin,
    LeanStepMixin,
    ShardedCheckpointMixin,
    CheckpointingMixin,
    transformers.Trainer,
):
    """Drop-in replacement for ``transformers.Trainer`` that needs no accelerate."""

    def __init__(self, model: Any = None, args: transformers.TrainingArguments | None = None, **kwargs: Any) -> None:
        _compat.install()  # the accelerate names transformers' Trainer reaches, set where missing (docs/runtime-patches.md)
        if args is not None and not isinstance(args, TrainingArguments):
            raise ConfigError(_foreign_arguments(args))
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")  # transformers' default for a Trainer without args
        super().__init__(model=model, args=args, **kwargs)
        self._check_context_parallel_support()
        self._fix_loss_kwargs_detection()
        # the engine's duties run after the user's callbacks but are not listed among them (drop-in: a script sees
        # transformers' callback list); a user's own instance of one, listed, takes its place
        duties = [RunSummaryCallback(self)] if getattr(args, "run_summary", False) else []
        duties += [
            MainProcessLoggingCallback(self),
            BarrierCallback(),
            UnwrapAndSaveCallback(self, save_final=getattr(args, "save_final_model", False)),
        ]
        self.callback_handler = DutyCallbackHandler.wrap(self.callback_handler, duties)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``train``; while it runs, its loop's accelerate names lead to ours (``compat``)."""
        with _compat.training_loop_names():
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def _fix_loss_kwargs_detection(self) -> None:
        """Only trust token-count normalisation from models whose loss really uses ``num_items_in_batch``."""
        if self.model is None or not self.model_accepts_loss_kwargs or self.compute_loss_func is not None:
            return
        uses = _compat.loss_uses_num_items(self.accelerator.unwrap_model(self.model))
        if uses is False:
            # transformers would skip the 1/accumulation division and multiply by the world size for a loss
            # that is already a per-micro-batch mean; treat it as the mean it is.
            self.model_accepts_loss_kwargs = False
            if self.is_world_process_zero():
                _log_mean_loss_head(type(self.model).__name__, self.args)

    def store_flos(self) -> None:
        """transformers sums every process's count; the ranks of one tensor-parallel group ran the same batch."""
        self.current_flos /= self.accelerator.same_batch_size
        super().store_flos()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add the count of optimizer steps skipped by the fp16 loss scaler to the training logs."""
        if self.accelerator.scaler is not None and "loss" in logs:
            logs["skipped_optimizer_steps"] = self.accelerator.skipped_steps
        super().log(logs, *args, **kwargs)

    def _prepare_input(self, data: Any) -> Any:
        """Under DeepSpeed, float inputs (pixel values, audio) also take the engine's dtype, as in transformers."""
        data = super()._prepare_input(data)
        if not isinstance(data, torch.Tensor) or not torch.is_floating_point(data):
            return data  # mappings and sequences come back here element by element (transformers recurses)
        dtype = self.accelerator.strategy.input_dtype()
        return data if dtype is None else data.to(dtype)

    def _prepare_for_training(self, max_steps: int, *args: Any, **kwargs: Any) -> Any:
        """Tell the engine the schedule length first: DeepSpeed's ``"auto"`` scheduler values need it."""
        self.accelerator.training_steps = (max_steps, self.args.get_warmup_steps(max_steps))
        return super()._prepare_for_training(max_steps, *args, **kwargs)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """A scheduler from the DeepSpeed config is stepped by DeepSpeed: the Trainer gets a view that does not step."""
        scheduler = self.accelerator.strategy.backend_scheduler()
        if self.lr_scheduler is None and scheduler is not None:
            self.lr_scheduler = SteppedByEngine(scheduler)
            self._created_lr_scheduler = True
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def create_accelerator_and_postprocess(self) -> None:
        """Build the engine in place of ``accelerate.Accelerator`` and set what ``__init__`` reads next."""
        args = self.args
        config = _compat.accelerator_config(args.accelerator_config)
        grad_acc_kwargs = dict(config.gradient_accumulation_kwargs or {})
        if "num_steps" in grad_acc_kwargs:
            if args.gradient_accumulation_steps > 1:
                # transformers' type and words first, then which one to keep
                raise ConfigError(
                    "The `AcceleratorConfig`'s `num_steps` is set but `gradient_accumulation_steps` is greater than 1 "
                    "in the passed `TrainingArguments`. If using the passed `AcceleratorConfig` is desired, do not "
                    "set the `TrainingArguments` `gradient_accumulation_steps` (keep only one of the two)."
                )
            args.gradient_accumulation_steps = grad_acc_kwargs["num_steps"]
        # as under accelerate: the Trainer accumulates itself, so the plugin's own count is 1; defaults are not listed
        grad_acc_kwargs["num_steps"] = 1
        grad_acc_kwargs = {k: v for k, v in grad_acc_kwargs.items() if _ACCUMULATION_DEFAULTS.get(k, object()) != v}
        compile_kwargs = None
        if args.torch_compile:
            compile_kwargs = {"backend": args.torch_compile_backend or "inductor"}
            if args.torch_compile_mode:
                compile_kwargs["mode"] = args.torch_compile_mode
        strategy, options = None, _ddp_options(self)
        if args.fsdp_plugin_args is not None:
            strategy, options = "fsdp", {"settings": args.fsdp_plugin_args}
        elif getattr(args, "hf_deepspeed_config", None) is not None:
            strategy, options = "deepspeed", {"config": args.hf_deepspeed_config}
        self.accelerator = Engine(
            args.distributed_state,
            parallelism_config=_parallelism_of(args, self.model),
            mixed_precision=args.mixed_precision,
            strategy=strategy,
            strategy_options=options,
            seed=args.data_seed,
            split_batches=config.split_batches,
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            use_seedable_sampler=config.use_seedable_sampler,
            torch_compile=compile_kwargs,
            gradient_accumulation_plugin_kwargs=grad_acc_kwargs,
            scaler_kwargs={"init_scale": args.fp16_init_scale, "growth_interval": args.fp16_growth_interval},
        )
        align_accelerate_state(self.accelerator)  # TRL calls accelerate's free functions: they must see our ranks
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=args.eval_use_gather_object
            )
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = False
