"""The estimate in ``train``'s start-up block, and a warning before training when it exceeds the device memory.

The limit is the CUDA device's memory, or ``device_memory`` when the arguments carry it (on CPU there is no limit
otherwise: host memory is shared with everything else on the machine).
"""

from __future__ import annotations

import logging
from typing import Any

from ..values import format_size, parse_size
from .breakdown import estimate
from .fit import largest_batch, remedies
from .report import format_breakdown
from .setup import setup_from_values
from .shape import ModelShape

logger = logging.getLogger("trainer_ext.estimate")


def device_memory_limit(args: Any) -> int | None:
    """Bytes one rank may use: ``args.device_memory`` when set, else the CUDA device's total memory, else None."""
    given = getattr(args, "device_memory", None)
    if given:
        return parse_size(given, "device memory")
    device = getattr(args, "device", None)
    if device is not None and device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return None


def _sequence_length(args: Any, dataset: Any) -> int:
    if args.task != "sequence-classification" or dataset is None:
        return args.max_seq_length
    try:
        sample = dataset.select(range(min(len(dataset), 10_000))).with_format(None)["input_ids"]
        return min(args.max_seq_length, max(len(ids) for ids in sample))
    except (AttributeError, KeyError, TypeError, ValueError):
        return args.max_seq_length


def setup_for(args: Any, world_size: int, seq_len: int):
    """The Setup of built TrainJobArguments (FSDP settings in their normal form, the DeepSpeed config as given)."""
    values = {name: getattr(args, name, None) for name in ("bf16", "fp16", "per_device_train_batch_size")}
    values.update(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        optim=getattr(args.optim, "value", args.optim),
        activation_checkpointing=getattr(args, "activation_checkpointing", None),
        gradient_checkpointing=getattr(args, "gradient_checkpointing", None),
        deepspeed=args.deepspeed,
    )
    if getattr(args, "fsdp_plugin_args", None) is not None:
        values.update(fsdp=True, fsdp_config=args.fsdp_plugin_args)
    return setup_from_values(values, world_size, seq_len)


def startup_estimate(trainer: Any) -> str | None:
    """Print the per-rank estimate (main process) and warn, naming the fixing flags, when it exceeds the limit.

    Returns the printed block. Never fails the job: an estimate that cannot be made is skipped with a debug log.
    """
    args = trainer.args
    try:
        shape = ModelShape.from_model(trainer.model)
        setup = setup_for(args, args.world_size, _sequence_length(args, trainer.train_dataset))
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
