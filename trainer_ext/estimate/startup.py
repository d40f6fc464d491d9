"""The estimate in ``train``'s start-up block, and a warning before training when it exceeds the device memory.

The limit is the CUDA device's memory, or ``device_memory`` when the arguments carry it (on CPU there is no limit
otherwise: host memory is shared with everything else on the machine).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from trainer_ext.errors import ConfigError
from trainer_ext.estimate.breakdown import estimate
from trainer_ext.estimate.fit import largest_batch, remedies
from trainer_ext.estimate.lengths import sample_column, sequence_length
from trainer_ext.estimate.report import format_breakdown
from trainer_ext.estimate.setup import setup_from_values
from trainer_ext.estimate.shape import ModelShape, weight_bytes
from trainer_ext.values import format_size, parse_size

logger = logging.getLogger("trainer_ext.estimate")


def device_memory_bytes(text: str, flag: str = "--device_memory") -> int:
    """The bytes of a ``--device_memory`` size ("80GiB", "24GB"); ConfigError unless more than 0."""
    limit = parse_size(text, flag)
    if limit <= 0:
        raise ConfigError(f"{flag} must be more than 0 bytes, got {text!r}")
    return limit


def device_memory_limit(args: Any) -> int | None:
    """Bytes one rank may use: ``args.device_memory`` when set, else the CUDA device's total memory, else None."""
    given = getattr(args, "device_memory", None)
    if given:
        return device_memory_bytes(given)
    device = getattr(args, "device", None)
    if device is not None and device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return None


def _sequence_length(args: Any, dataset: Any) -> int:
    lengths = None
    if args.task == "sequence-classification" and dataset is not None:
        try:
            lengths = [len(ids) for ids in sample_column(dataset, "input_ids")]
        except (AttributeError, KeyError, TypeError, ValueError):
            lengths = None
    return sequence_length(args, lengths)


def setup_for(args: Any, world_size: int, seq_len: int):
    """The Setup of built TrainJobArguments: FSDP from the settings the arguments already read
    (``fsdp_plugin_args``), the DeepSpeed config as given."""
    from trainer_ext.distributed.strategies.fsdp.config import FSDPSettings

    names = ("bf16", "fp16", "per_device_train_batch_size", "task", "loss_type", "reference_free")
    values = {name: getattr(args, name, None) for name in names}
    values.update(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        optim=getattr(args.optim, "value", args.optim),
        optim_args=getattr(args, "optim_args", None),
        activation_checkpointing=getattr(args, "activation_checkpointing", None),
        gradient_checkpointing=getattr(args, "gradient_checkpointing", None),
        deepspeed=args.deepspeed,
    )
    # the mesh's sizes: TP splits layers, CP sequences, PP the model into stages, dp_shard x cp runs FSDP2
    config = getattr(args, "parallelism_config", None)
    if config is not None:
        names = ("dp_replicate", "dp_shard", "tp", "cp", "pp")
        values.update({f"{name}_size": getattr(config, f"{name}_size", 1) or 1 for name in names})
        values["cp_backend"] = getattr(config, "cp_backend", None)
        values["pp_schedule"] = getattr(config, "pp_schedule", None)
        values["pp_microbatches"] = getattr(config, "pp_microbatches", None)
    plugin = getattr(args, "fsdp_plugin_args", None)
    settings = FSDPSettings.from_dict(plugin) if plugin is not None else None
    device = getattr(getattr(args, "device", None), "type", None) or "cpu"
    return setup_from_values(values, world_size, seq_len, fsdp_settings=settings, device_type=device)


def startup_estimate(trainer: Any) -> str | None:
    """Print the per-rank estimate (main process) and warn, naming the fixing flags, when it exceeds the limit.

    Returns the printed block. Never fails the job: an estimate that cannot be made is skipped with a debug log.
    """
    args = trainer.args
    try:
        shape = ModelShape.from_model(trainer.model)
        reference = getattr(trainer, "ref_model", None)  # DPO's frozen reference, held whole beside the model
        if reference is not None:
            shape = dataclasses.replace(shape, reference_bytes=weight_bytes(reference))
        setup = setup_for(args, args.world_size, _sequence_length(args, trainer.train_dataset))
        if setup.pp_size > 1 and getattr(trainer.model, "_trainer_ext_pipeline", None) is not None:
            # already split: the model is this rank's stages, estimated as one stage's data-parallel job
            setup = setup.replace(pp_size=1, world_size=max(setup.world_size // setup.pp_size, 1))
        limit = device_memory_limit(args)
        breakdown = estimate(shape, setup)
    except Exception as error:  # noqa: BLE001 - an estimate must never stop a training job
        logger.debug("no memory estimate: %s", error)
        return None
    lines = ["***** trainer_ext: memory estimate per rank *****", format_breakdown(breakdown, setup, indent="  ")]
    if limit is not None:
        batch = largest_batch(shape, setup, limit)
        lines.append(f"  largest micro-batch that fits {format_size(limit)}: {batch}")
    text = "\n".join(lines)
    if args.process_index == 0:
        print(text, flush=True)
        if limit is not None and breakdown.peak > limit:
            logger.warning(exceeds_message(shape, setup, breakdown.peak, limit))
    return text


def exceeds_message(shape: ModelShape, setup: Any, peak: int, limit: int) -> str:
    """The warning: the estimate, the limit and the flags that would make it fit."""
    fixes = remedies(shape, setup, limit)
    listed = "; ".join(f"{r.flags} -> {format_size(r.peak)}{'' if r.fits else ' (not enough alone)'}" for r in fixes)
    return (
        f"the estimated peak memory per rank, {format_size(peak)}, exceeds the device memory {format_size(limit)}; "
        f"this run will likely run out of memory. To fit, try: {listed or 'a smaller model or more processes'} "
        "(see trainer-ext estimate)"
    )
