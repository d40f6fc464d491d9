"""What fits a device: the largest micro-batch, and the flags that bring a job that does not fit under the limit."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer_ext.estimate.breakdown import estimate
from trainer_ext.estimate.setup import Setup
from trainer_ext.estimate.shape import ModelShape

MAX_BATCH = 1 << 20


def largest_batch(shape: ModelShape, setup: Setup, device_memory: int) -> int:
    """The largest per-device micro-batch whose peak fits ``device_memory`` (0: not even one sequence)."""

    def fits(batch: int) -> bool:
        return estimate(shape, setup, batch).peak <= device_memory

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_BATCH and fits(high):
        low, high = high, high * 2
    if high > MAX_BATCH:
        return MAX_BATCH
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def checkpointing_flag() -> str:
    """``--activation_checkpointing`` where transformers has it (5.23+), else ``--gradient_checkpointing``."""
    import transformers

    fields = transformers.TrainingArguments.__dataclass_fields__
    return "--activation_checkpointing" if "activation_checkpointing" in fields else "--gradient_checkpointing"


@dataclass(frozen=True)
class Remedy:
    """Flags to add and the per-rank peak they give."""

    flags: str
    peak: int
    fits: bool


def smaller_batch(setup: Setup, batch: int) -> tuple[str, Setup]:
    """Flags for a micro-batch of at most ``batch`` with more accumulation: the same examples per optimizer step
    when a divisor of them fits (at least half of ``batch``), else ``batch`` and the label says how the step changes."""
    per_step = setup.micro_batch * setup.accumulation  # examples per rank per optimizer step
    divisor = max(d for d in range(1, batch + 1) if per_step % d == 0)
    if 2 * divisor > batch:
        batch, accumulation = divisor, per_step // divisor
        note = "same global batch"
    else:
        accumulation = math.ceil(per_step / batch)
        note = f"global batch changes: {batch * accumulation} instead of {per_step} examples per rank per step"
    flags = f"--per_device_train_batch_size {batch} --gradient_accumulation_steps {accumulation} ({note})"
    return flags, setup.replace(micro_batch=batch, accumulation=accumulation)


def remedies(shape: ModelShape, setup: Setup, device_memory: int) -> list[Remedy]:
    """Changes that lower the peak, those that fit first (each alone; combine them when none fits)."""
    options: list[tuple[str, Setup]] = []
    batch = largest_batch(shape, setup, device_memory)
    if 0 < batch < setup.micro_batch:
        options.append(smaller_batch(setup, batch))
    if not setup.checkpointing:
        options.append((checkpointing_flag(), setup.replace(checkpointing=True)))
    multi = setup.world_size > 1
    if setup.strategy in ("single", "ddp") and multi:
        options.append(("--fsdp full_shard", setup.replace(strategy="fsdp")))
        options.append(("--deepspeed configs/deepspeed/zero3.json", setup.replace(strategy="deepspeed", zero_stage=3)))
    if setup.strategy == "deepspeed" and setup.zero_stage < 3:
        options.append(("--deepspeed configs/deepspeed/zero3.json", setup.replace(zero_stage=3)))
    if setup.strategy == "fsdp" and not setup.offload_params:
        offloaded = setup.replace(offload_params=True, offload_optimizer=True)
        options.append(("--fsdp 'full_shard offload'", offloaded))
    if setup.strategy != "fsdp" and not setup.offload_optimizer:
        stage = 3 if setup.strategy != "deepspeed" or setup.zero_stage >= 2 else 2
        config = "zero3_offload" if stage == 3 else "zero2_offload"
        offloaded = setup.replace(
            strategy="deepspeed", zero_stage=stage, offload_optimizer=True, offload_params=stage == 3
        )
        options.append((f"--deepspeed configs/deepspeed/{config}.json", offloaded))
    found = []
    for flags, changed in options:
        peak = estimate(shape, changed).peak
        found.append(Remedy(flags, peak, peak <= device_memory))
    return sorted(found, key=lambda r: (not r.fits, r.peak))
