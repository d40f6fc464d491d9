"""``launch ... train --parallelism auto``: the train arguments with the plan's first layout for the machines and
processes the launch runs (:mod:`trainer_ext.cli.parallelism`), resolved once here so that every process starts with
the same explicit flags. The launch's own layout settings (``--deepspeed``, FSDP, the sizes, accumulation) reach the
plan as the train flags they become, and fix that part of the layout as train's own flags do."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from trainer_ext.cli.launch.handoff import train_sources
from trainer_ext.cli.launch.parallel import ParallelPlan, check_sizes
from trainer_ext.cli.launch.target import Target
from trainer_ext.job.parallel import TRAIN_SIZES

if TYPE_CHECKING:
    from trainer_ext.cli.launch.settings import Settings

SOURCE = "--parallelism auto"


def resolve_auto(
    s: Settings, target: Target, notes: list[str], parallel: ParallelPlan | None = None
) -> tuple[Target, ParallelPlan | None, dict[str, str]] | None:
    """``target`` (train with the launch's settings added as flags) with the plan's layout, the mesh that layout
    gives and the variables telling the processes what was chosen; None unless the train arguments ask for auto."""
    if "parallelism" not in train_sources(target.args):
        return None
    from trainer_ext.cli import parallelism
    from trainer_ext.cli.main import check_train_flags
    from trainer_ext.job.flags import parse_train_values

    values = check_train_flags(target.args)
    if not parallelism.requested(values):
        return None
    cpu = s["device"] != "cuda" or parallelism.truthy(values.get("use_cpu"))
    gpu = s.gpus[0] if s["device"] == "cuda" and s.gpus else 0
    cluster = parallelism.cluster_for(s["num_machines"], s["nproc_per_node"], cpu, values.get("device_memory"), gpu)
    resolved = parallelism.resolve(target.args, cluster)
    notes.append(f"parallelism auto: {resolved.text}; its flags: {shlex.join(resolved.flags)}")
    chosen = parse_train_values(resolved.argv)[0]
    device = s["device"] or "cpu"
    config = check_sizes(
        {name: chosen.get(name) for name in TRAIN_SIZES},
        s.world_size,
        chosen.get("deepspeed"),
        SOURCE,
        chosen.get("cp_backend"),
        device,
        chosen.get("pp_schedule"),
        chosen.get("pp_microbatches"),
    )
    kept = parallel.notes if parallel is not None else []
    mesh = None if config is None else ParallelPlan(config, f"from {SOURCE}", [], kept, device)
    return Target(target.kind, target.name, resolved.argv, target.swap), mesh, parallelism.auto_env(resolved)
