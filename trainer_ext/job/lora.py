"""LoRA from the command line: the job's model wrapped by peft's ``get_peft_model``, and the merged export.

``--lora_r`` and its companions are checked in ``trainer_ext.job.arguments.LoraArguments``; this module runs them.
peft is an optional extra, imported here only when a job asks for LoRA (``import trainer_ext`` never imports it).
Saving needs nothing of ours: the Trainer and ``UnwrapAndSaveCallback`` write (and check) a peft model as its
adapter, ``adapter_model.safetensors`` + ``adapter_config.json``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import transformers

from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.job.arguments import TrainJobArguments
from trainer_ext.job.lora_arguments import ALL_LINEAR, PEFT_INSTALL

logger = logging.getLogger(__name__)

# peft's task type for each task of ours: it decides the wrapper class, and SEQ_CLS keeps the classifier head
# trainable and saved with the adapter (peft adds ``classifier``/``score`` to ``modules_to_save``).
TASK_TYPES = {"causal-lm": "CAUSAL_LM", "sft": "CAUSAL_LM", "dpo": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}
MERGED_DIR = "merged"  # under output_dir: the model with the adapters merged in (--merge_lora)


def apply_lora(args: TrainJobArguments, model: transformers.PreTrainedModel) -> torch.nn.Module:
    """``model`` wrapped with LoRA adapters as the flags say; only the adapters (and a classifier head) train.

    Runs before anything is written, so a target module that is not in the model is a ConfigError like any bad flag.
    """
    try:
        from peft import LoraConfig, TaskType, get_peft_model
    except ImportError as error:  # installed but broken (the arguments already checked that it is installed)
        raise ConfigError(
            f"--lora_r needs peft, which does not import ({error}); reinstall it: {PEFT_INSTALL}"
        ) from error
    _check_targets(args.lora_target_modules, model)
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.lora_target_modules,
        task_type=TaskType[TASK_TYPES[args.task]],
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as error:  # no default targets for this model type, or targets not in the model
        raise ConfigError(
            f"LoRA cannot be applied to this {model.config.model_type} model: {' '.join(str(error).split())} Pass "
            f"--lora_target_modules {ALL_LINEAR}, or comma-separated names of its linear layers: "
            f"{', '.join(linear_layer_names(model))}"
        ) from error
    if args.task == "sequence-classification" and not _head_trains(peft_model):
        raise ConfigError(
            f"the classification head of this {model.config.model_type} model is named neither 'classifier' nor "
            "'score', so under LoRA it would stay frozen at its random start; fine-tune without --lora_r, or wrap "
            "the model yourself with LoraConfig(modules_to_save=[<head name>]) and trainer_ext.Trainer"
        )
    if args.process_index == 0:
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in peft_model.parameters())
        targets = sorted(peft_model.peft_config["default"].target_modules or [])
        logger.info(
            "LoRA r=%d alpha=%s dropout=%s on %s: %d of %d parameters train (%.2f%%)",
            args.lora_r,
            args.lora_alpha,
            args.lora_dropout,
            ", ".join(targets) if len(targets) <= 8 else f"{len(targets)} modules",
            trainable,
            total,
            100 * trainable / max(total, 1),
        )
        if args.from_scratch and not args.merge_lora:
            logger.warning(
                "LoRA on a model built from scratch: its random base weights are not saved, so the adapter in %s "
                "only reloads onto a base rebuilt with the same --seed. Add --merge_lora for a standalone model, or "
                "--model_name_or_path to adapt a pretrained one",
                args.output_dir,
            )
    return peft_model


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of a model's linear layers but its output head (``q_proj``, ``query`` …): what
    --lora_target_modules takes."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    linear = (torch.nn.Linear, Conv1D)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, linear) and module is not head
        }
    )


def _check_targets(targets: str | list[str] | None, model: torch.nn.Module) -> None:
    """ConfigError for each listed name that matches no module (peft itself skips it silently when another matches)."""
    if not isinstance(targets, list):
        return
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        valid = linear_layer_names(model)
        hints = "".join(did_you_mean(t, valid) for t in missing)
        raise ConfigError(
            f"--lora_target_modules: {', '.join(repr(t) for t in missing)} {'is' if len(missing) == 1 else 'are'} "
            f"not a module of this {model.config.model_type} model.{hints} Pass --lora_target_modules {ALL_LINEAR}, "
            f"or comma-separated names of its linear layers: {', '.join(valid)}"
        )


def _head_trains(model: torch.nn.Module) -> bool:
    """True when some parameter outside the adapters trains: peft's trainable copy of the classifier head."""
    return any(p.requires_grad and "lora_" not in name for name, p in model.named_parameters())


def save_merged(trainer: transformers.Trainer, folder: str | os.PathLike) -> Path | None:
    """Merge the trained adapters into the base weights and write that plain model and the tokenizer to ``folder``.

    The merge happens in place (no second copy of the model in memory), so call it last: afterwards the job's model
    is the merged one. The files are checked like the final model. Only the saving process writes; returns the folder.
    """
    if not trainer.args.should_save:
        return None
    from trainer_ext.callbacks.unwrap_and_save import save_unwrapped, verify_saved_model

    model: Any = trainer.accelerator.unwrap_model(trainer.model_wrapped, keep_torch_compile=False)
    merged = model.merge_and_unload()
    save_unwrapped(merged, folder, trainer.processing_class)
    verify_saved_model(merged, folder, trainer.processing_class)
    logger.info("model with the LoRA adapters merged in saved to %s", folder)
    return Path(folder)
