"""``--parallelism auto``: ``trainer-ext train`` and ``trainer-ext launch ... train`` set the layout to the plan's first
choice before any training process parses its flags, so that every rank starts with the same explicit flags.

The plan is ``trainer-ext plan``'s (:func:`trainer_ext.plan.planner.make_plan`) for the processes the run has (the
launch's machines and processes per machine; under torchrun ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``), on the device
they run on: the job's ``--device_memory`` when it sets one, else the memory of the first CUDA device, else (CPU
processes) no limit, where the plan's step-time model alone picks. The global batch is the job's own
(``per_device_train_batch_size`` x ``gradient_accumulation_steps`` x its data-parallel ranks). The layout flags the job
gives (``--fsdp``, ``--deepspeed``, the sizes) fix that part of the layout, and their own words are kept (a DeepSpeed
file, FSDP settings); the rest of the layout (the family, sizes, micro-batch, accumulation, activation checkpointing)
is replaced by the plan's flags. DeepSpeed's layouts are left out when deepspeed is not installed (unless the job asks
for DeepSpeed itself). When nothing fits, one ConfigError line says what would, before any process starts.

The processes learn what was chosen from ``TRAINER_EXT_PARALLELISM_AUTO`` (:mod:`trainer_ext.env_vars`): the
start-up block prints it, and ``train`` refuses an unresolved ``--parallelism auto`` without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer_ext import env_vars
from trainer_ext.errors import ConfigError

AUTO = "auto"


@dataclass
class Resolved:
    """The train argv with the plan's layout, the flags that were added, and the start-up block's text."""

    argv: list[str]
    flags: list[str]
    text: str
    layout: Any


def requested(values: Mapping[str, Any]) -> bool:
    """Whether the train flag values (command line and ``--config`` files) ask for ``--parallelism auto``."""
    return values.get("parallelism") == AUTO


def already_resolved() -> bool:
    """Whether a launcher resolved it for this process already (its flags are on the command line)."""
    return bool(os.environ.get(env_vars.PARALLELISM_AUTO))


def cluster_for(num_machines: int, per_machine: int, cpu: bool, device_memory: str | None, gpu: int = 0) -> Any:
    """The Cluster the run has: the job's ``--device_memory``, else the CUDA device's memory, else no limit (CPU)."""
    import torch

    from trainer_ext.estimate.startup import device_memory_bytes
    from trainer_ext.plan.cluster import Cluster, parse_interconnect

    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    memory = device_memory_bytes(device_memory) if device_memory else 0
    if not memory and device == "cuda":
        memory = torch.cuda.get_device_properties(gpu).total_memory
    within, between = parse_interconnect(None, num_machines, device)
    return Cluster(num_machines, per_machine, memory, within, between, device)


def describe_cluster(cluster: Any) -> str:
    """``2 CPU processes``, ``8 GPUs of 80 GiB``, ``2 machines x 8 GPUs of 80 GiB``."""
    from trainer_ext.values import format_size

    kind = "CPU process" if cluster.device == "cpu" else "GPU"
    many = ("es" if kind == "CPU process" else "s") if cluster.per_machine > 1 else ""
    memory = f" of {format_size(cluster.device_memory)}" if cluster.device_memory else ""
    text = f"{cluster.per_machine} {kind}{many}{memory}"
    return text if cluster.num_machines == 1 else f"{cluster.num_machines} machines x {text}"


def resolve(argv: Sequence[str], cluster: Any, more_processes: str = "--nproc_per_node") -> Resolved:
    """The train ``argv`` with the plan's first layout on ``cluster``; ConfigError (one line) when none fits, with
    what would (``more_processes``: the flag that asks for more processes where the run is started)."""
    from trainer_ext.estimate.fit import checkpointing_flag
    from trainer_ext.job.flags import parse_train_values
    from trainer_ext.plan.layouts import PLANNED_FLAGS, drop_flags
    from trainer_ext.plan.planner import make_plan, smallest_change

    argv = list(argv)
    values = parse_train_values(argv)[0]
    plan = make_plan(argv, cluster)
    ranked = plan.ranked
    if not values.get("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        ranked = [c for c in ranked if not c.layout.family.startswith("zero")]
    where = describe_cluster(cluster)
    if plan.ranked and not ranked:
        raise ConfigError(
            f"--parallelism auto: only DeepSpeed layouts fit {where} and deepspeed is not installed: "
            "pip install 'deepspeed>=0.16'"
        )
    if not ranked:
        changes = smallest_change(argv, cluster, plan.global_batch, plan.job)
        changes = [change.replace("--gpus_per_machine", more_processes) for change in changes]
        what = "; or ".join(changes) if changes else "a smaller model or more memory per device"
        raise ConfigError(
            f"--parallelism auto: no layout fits {where} at global batch {plan.global_batch} (trainer-ext plan "
            f"lists the layouts); it fits with {what}"
        )
    layout = ranked[0].layout
    flags = _layout_flags(layout, values, checkpointing_flag())
    kept = drop_flags(argv, {name for name in PLANNED_FLAGS if not _fixed_by_user(name, values, layout)})
    which = f"first of the {len(ranked)} planned layouts" if len(ranked) > 1 else "the one planned layout"
    text = f"{layout.name()} ({which} that fit{'s' * (len(ranked) == 1)} {where})"
    return Resolved([*kept, *flags], flags, text, layout)


def _fixed_by_user(name: str, values: Mapping[str, Any], layout: Any) -> bool:
    """The job's own --deepspeed (the plan kept its stage and offload) and --fsdp words are kept as given."""
    if name == "deepspeed":
        return bool(values.get("deepspeed"))
    if name == "fsdp":
        from trainer_ext.distributed.strategies.fsdp.config import fsdp_requested

        return fsdp_requested(values.get("fsdp")) and layout.family in ("fsdp", "hsdp")
    return False


def _layout_flags(layout: Any, values: Mapping[str, Any], checkpointing: str) -> list[str]:
    """The layout's train flags: the shipped DeepSpeed config by its absolute path (else inline), the job's own --deepspeed
    or --fsdp words in place of the layout's, and activation checkpointing turned off explicitly when a ``--config``
    file turned it on and the layout does without."""
    flags = layout.flags(checkpointing)
    found: list[str] = []
    i = 0
    while i < len(flags):
        word = flags[i]
        if word in ("--deepspeed", "--fsdp"):
            if not _fixed_by_user(word[2:], values, layout):
                value = flags[i + 1]
                if word == "--deepspeed":
                    value = _deepspeed_file(value) or json.dumps(
                        layout.values()["deepspeed"], sort_keys=True, separators=(",", ":")
                    )
                found += [word, value]
            i += 2
            continue
        found.append(word)
        i += 1
    if not layout.checkpointing:
        found += [f"--{name}", "false"] if (name := _checkpointing_on(values)) else []
    return found


def _deepspeed_file(relative: str) -> str | None:
    """The shipped DeepSpeed config (``configs/deepspeed/zero2.json``) by its absolute path, when this checkout has it:
    the job may run from any folder."""
    path = Path(__file__).resolve().parents[2] / relative
    return str(path) if path.is_file() else None


def _checkpointing_on(values: Mapping[str, Any]) -> str | None:
    from trainer_ext.plan.layouts import CHECKPOINTING_FLAGS

    return next((name for name in CHECKPOINTING_FLAGS if truthy(values.get(name))), None)


def truthy(value: Any) -> bool:
    """A boolean flag's value as train reads it (a config file's true, the words yes/true/1)."""
    from trainer_ext.job.flag_spec import TRUE_WORDS

    return value is True or (isinstance(value, str) and value.lower() in TRUE_WORDS)


def auto_env(resolved: Resolved) -> dict[str, str]:
    """What the processes read: the start-up block's text, which also says the flags are resolved."""
    return {env_vars.PARALLELISM_AUTO: resolved.text}
