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

from trainer_ext.checkpointing import sharded as sharded_checkpoint
from trainer_ext.checkpointing import together
from trainer_ext.distributed.strategies import checkpoint_owner
from trainer_ext.errors import ConfigError
from trainer_ext.trainer.checkpoints import refuse_saved_links

logger = logging.getLogger(__name__)


class ShardedCheckpointMixin:
    """Mix in before ``transformers.Trainer``; every method falls back to transformers' own for whole models.

    What a sharded checkpoint holds and how it is written is the strategy's (``self.accelerator.strategy``); loading
    goes by what the checkpoint folder holds.
    """

    export_max_shard_size: str | int = "5GB"  # largest safetensors file of the consolidated export

    def _trained_model(self) -> torch.nn.Module:
        return self.model_wrapped if self.model_wrapped is not None else self.model

    def model_is_sharded(self) -> bool:
        """True once no rank holds the trained model whole (FSDP-sharded, or inside a DeepSpeed engine)."""
        return self.accelerator.strategy.shards_model(self._trained_model())

    def _own_format(self) -> bool:
        """True when the strategy checkpoints the trained model in a format of its own (DeepSpeed's)."""
        return self.accelerator.strategy.writes_own_checkpoint(self._trained_model())

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Checkpoints of a sharded model: its shards; otherwise (final save): consolidated safetensors.

        A final save refuses a link where it writes (the link rule; a checkpoint's folder was checked before)."""
        if not _internal_call:
            where = output_dir if output_dir is not None else self.args.output_dir
            if self.model_is_sharded():  # every rank is here (the export gathers): all refuse, none waits
                together.agreed(lambda: refuse_saved_links(where) if self.args.should_save else None, str, ConfigError)
            elif self.args.should_save:
                refuse_saved_links(where)
        if not self.model_is_sharded():
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model, strategy = self._trained_model(), self.accelerator.strategy
        if _internal_call:
            strategy.save_checkpoint_model(model, output_dir)
            config = getattr(strategy.unwrap(model), "config", None)
            if self.args.should_save and config is not None:
                config.save_pretrained(output_dir)
        else:
            strategy.export_model(
                model, output_dir, max_shard_size=self.export_max_shard_size, is_main_process=self.args.should_save
            )
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.model_is_sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        self.accelerator.strategy.save_checkpoint_optimizer(self._trained_model(), self.optimizer, output_dir)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return None
        full = Path(checkpoint) / OPTIMIZER_NAME
        strategy, owner = self.accelerator.strategy, checkpoint_owner(checkpoint)
        if self._own_format() or owner is not None:
            if owner is None or not self._own_format() or not isinstance(strategy, owner):
                title = owner.title if owner is not None else strategy.title
                raise ConfigError(
                    f"{Path(checkpoint).name}: a {title} checkpoint resumes only under {title}, and a {title} "
                    f"run only from a {title} checkpoint; start a new run from a saved model "
                    "(--model_name_or_path) instead"
                )
            strategy.load_own_checkpoint(self._trained_model(), checkpoint)  # model, optimizer, backend state
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
        if checkpoint_owner(resume_from_checkpoint) is not None:
            return None  # loaded by its backend with the optimizer, once it exists (_load_optimizer_and_scheduler)
        if not sharded_checkpoint.has_sharded_model(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        sharded_checkpoint.load_model(model if model is not None else self.model, resume_from_checkpoint)
        return None

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is not None and self._own_format() and checkpoint_owner(best) is not None:
            logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
            self.accelerator.strategy.load_own_checkpoint(self._trained_model(), best)
            return None
        if best is None or not sharded_checkpoint.has_sharded_model(best):
            return super()._load_best_model()
        logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        sharded_checkpoint.load_model(self._trained_model(), best)
        return None
