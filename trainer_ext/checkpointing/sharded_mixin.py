"""Trainer overrides for models no rank holds whole (FSDP2, DeepSpeed): their checkpoints and the consolidated export.

transformers only writes these through accelerate's plugins. Here, when the trained model is FSDP-sharded,
``checkpoint-N`` holds ``model_sharded/`` and ``optimizer_sharded/`` (``torch.distributed.checkpoint``, every rank
writing its shards); under DeepSpeed it holds the engine's own checkpoint (``global_stepN/`` + ``latest``). The
scheduler, RNG and trainer state sit next to them as usual, and ``save_model()`` writes consolidated safetensors.
Loading goes by what a checkpoint holds, not by the current flags: a sharded checkpoint resumes on N ranks with
FSDP or on one process without it, and an unsharded one resumes under FSDP.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINING_ARGS_NAME

from ..distributed import sharded_checkpoint
from ..distributed.strategies.deepspeed import is_engine
from ..distributed.strategies.fsdp import is_sharded
from ..errors import ConfigError
from .marker import load_deepspeed_file

logger = logging.getLogger(__name__)
DEEPSPEED_LATEST = "latest"  # the file DeepSpeed writes next to its global_stepN folders


def has_deepspeed_checkpoint(directory: str | os.PathLike) -> bool:
    return (Path(directory) / DEEPSPEED_LATEST).is_file()


def deepspeed_saved_shapes(directory: str | os.PathLike) -> tuple[dict[str, list[int]], set[str]] | None:
    """Full shapes of the parameters in a DeepSpeed checkpoint (read ``weights_only``), and the trainable names.

    None when the checkpoint has no model-states file to read them from.
    """
    root = Path(directory)
    tag = (root / DEEPSPEED_LATEST).read_text(encoding="utf-8").strip()
    files = sorted((root / tag).glob("*model_states.pt"))
    if not files:
        return None
    saved = load_deepspeed_file(files[0])
    groups = saved.get("param_shapes") or []
    trainable = {name: list(shape) for group in groups for name, shape in group.items()}
    frozen = {name: list(shape) for name, shape in (saved.get("frozen_param_shapes") or {}).items()}
    return {**frozen, **trainable}, set(trainable)


def check_deepspeed_model(model: torch.nn.Module, directory: str | os.PathLike) -> None:
    """ConfigError when a DeepSpeed checkpoint holds another model (parameter names or full shapes differ)."""
    found = deepspeed_saved_shapes(directory)
    if found is None:
        return
    params = list(model.named_parameters())
    expected = {name: list(getattr(p, "ds_shape", p.shape)) for name, p in params}  # ZeRO-3 partitioned: ds_shape
    trainable = [name for name, p in params if p.requires_grad]  # frozen ones are saved only under some stages
    sharded_checkpoint.check_shapes(Path(directory).name, found[0], expected, must_have=trainable)


class ShardedCheckpointMixin:
    """Mix in before ``transformers.Trainer``; every method falls back to transformers' own for unsharded models."""

    export_max_shard_size: str | int = "5GB"  # largest safetensors file of the consolidated export

    def _trained_model(self) -> torch.nn.Module:
        return self.model_wrapped if self.model_wrapped is not None else self.model

    def model_is_sharded(self) -> bool:
        """True once the model has been sharded for training (FSDP) or wrapped in a DeepSpeed engine."""
        model = self._trained_model()
        return model is not None and (is_engine(model) or is_sharded(model))

    def _deepspeed(self) -> Any:
        """The DeepSpeed strategy when training runs under it, else None."""
        strategy = self.accelerator.strategy
        return strategy if getattr(strategy, "joint_prepare", False) and is_engine(self._trained_model()) else None

    def _save_deepspeed(self, strategy: Any, output_dir: str, checkpoint: bool) -> None:
        engine = self._trained_model()
        if checkpoint:
            strategy.save_checkpoint(engine, output_dir)
            if self.args.should_save and hasattr(engine.module, "config"):
                engine.module.config.save_pretrained(output_dir)
            return
        state = strategy.consolidated_state_dict(engine)  # gathered under ZeRO-3 on every rank; checked complete
        if self.args.should_save:
            module = engine.module
            if hasattr(module, "save_pretrained"):
                module.save_pretrained(output_dir, state_dict=state)
            else:
                from ..saving import save_model

                save_model(module, output_dir, state_dict=state)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Checkpoints of a sharded model: its shards; otherwise (final save): consolidated safetensors."""
        if not self.model_is_sharded():
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model = self._trained_model()
        deepspeed = self._deepspeed()
        if deepspeed is not None:
            self._save_deepspeed(deepspeed, output_dir, checkpoint=_internal_call)
        elif _internal_call:
            sharded_checkpoint.save_model(model, output_dir)
            if self.args.should_save and hasattr(model, "config"):
                model.config.save_pretrained(output_dir)
        else:
            stats = sharded_checkpoint.export_consolidated(
                model, output_dir, is_main_process=self.args.should_save, max_shard_size=self.export_max_shard_size
            )
            logger.info("saved the consolidated model to %s (%d file(s))", output_dir, stats["files"])
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.model_is_sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        if self._deepspeed() is None:  # DeepSpeed's checkpoint (save_model) holds its optimizer
            sharded_checkpoint.save_optimizer(self._trained_model(), self.optimizer, output_dir)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return None
        full = Path(checkpoint) / OPTIMIZER_NAME
        deepspeed = self._deepspeed()
        if deepspeed is not None or has_deepspeed_checkpoint(checkpoint):
            if deepspeed is None or not has_deepspeed_checkpoint(checkpoint):
                raise ConfigError(
                    f"{Path(checkpoint).name}: a DeepSpeed checkpoint resumes only under DeepSpeed, and a DeepSpeed "
                    "run only from a DeepSpeed checkpoint; start a new run from a saved model "
                    "(--model_name_or_path) instead"
                )
            deepspeed.load_checkpoint(self._trained_model(), checkpoint)  # model, optimizer, DeepSpeed state
        elif sharded_checkpoint.has_sharded_optimizer(checkpoint):
            sharded_checkpoint.load_optimizer(self._trained_model(), self.optimizer, checkpoint)
        elif self.model_is_sharded() and full.is_file():  # an unsharded checkpoint resumed under FSDP
            saved = torch.load(full, map_location="cpu", weights_only=True)
            sharded_checkpoint.load_full_optimizer(self._trained_model(), self.optimizer, saved)
        else:
            return super()._load_optimizer_and_scheduler(checkpoint)
        scheduler = Path(checkpoint) / SCHEDULER_NAME
        if scheduler.is_file() and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if has_deepspeed_checkpoint(resume_from_checkpoint):
            return None  # loaded into the engine with the optimizer, once it exists (_load_optimizer_and_scheduler)
        if not sharded_checkpoint.has_sharded_model(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        sharded_checkpoint.load_model(model if model is not None else self.model, resume_from_checkpoint)
        return None

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        deepspeed = self._deepspeed()
        if best is not None and deepspeed is not None and has_deepspeed_checkpoint(best):
            logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
            deepspeed.load_checkpoint(self._trained_model(), best)
            return None
        if best is None or not sharded_checkpoint.has_sharded_model(best):
            return super()._load_best_model()
        logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        sharded_checkpoint.load_model(self._trained_model(), best)
        return None
