"""The launch's parallel sizes (``--tp_size``, ``--dp_shard_size``, ``--dp_replicate_size``, ``--cp_size`` with
``--cp_backend``, ``--pp_size`` with ``--pp_schedule`` and ``--pp_microbatches``; ``--sp_size`` refused above 1):
checked before any process starts, shown as a mesh by the dry run (with the pipeline's schedule, microbatches and
bubble), and handed to the processes as accelerate's variables (``ACCELERATE_USE_PARALLELISM_CONFIG``,
``PARALLELISM_CONFIG_<SIZE>``, with context parallelism ``PARALLELISM_CONFIG_CP_BACKEND``, with pipeline parallelism
``PARALLELISM_CONFIG_PP_SCHEDULE`` and, when set, ``PARALLELISM_CONFIG_PP_MICROBATCHES``), which a script's
TrainingArguments or Accelerator read; ``train`` also gets them as flags.

For ``train`` the sizes its own arguments (or their ``--config`` files) set win over the launch's, as every other
train flag does; with ``tp_size``, ``cp_size`` or ``pp_size`` above 1 the model's config is read (a preset, a config
file, a local model folder) and a model without a tensor-parallel plan, with heads, key/value heads or an intermediate
size ``tp_size`` does not divide, one context parallelism would train wrongly (sliding-window, chunked, bidirectional
attention, ...), or one the pipeline cannot split into stages (tied embeddings, an unsupported architecture, fewer
layers than stages), is refused, wherever the sizes came from (flags, a launch config file, accelerate's keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer_ext import env_vars
from trainer_ext.cli.launch.handoff import train_sources
from trainer_ext.distributed.mesh.context_parallel import resolve_backend
from trainer_ext.distributed.mesh.setup import describe as mesh_text
from trainer_ext.errors import ConfigError
from trainer_ext.job.parallel import (
    LAUNCH_SIZES,
    PIPELINE_OPTIONS,
    TRAIN_SIZES,
    data_parallel_ranks,
    fitted,
    parallelism_from_sizes,
    pipeline_stages,
    pipeline_text,
)

if TYPE_CHECKING:
    from trainer_ext.cli.launch.settings import Settings
    from trainer_ext.distributed.mesh.config import ParallelismConfig

SIZES = LAUNCH_SIZES


@dataclass
class ParallelPlan:
    """The sizes the processes run with (fitted to the world), where they came from, and what they add."""

    config: ParallelismConfig
    source: str
    train_flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"  # where the processes run: the context-parallel backend ``auto`` resolves to depends on it

    def env(self) -> dict[str, str]:
        """accelerate's variables for a configuration that splits anything (the context-parallel backend with
        ``cp_size`` above 1); none for plain data parallelism."""
        if self.plain:
            return {}
        out = {env_vars.USE_PARALLELISM_CONFIG: "true"}
        # accelerate's sizes always; ours (pp) only when used, so accelerate's own scripts see accelerate's variables
        shown = [name for name in SIZES if name != "pp_size" or self.config.pp_size > 1]
        out.update(
            {env_vars.PARALLELISM_CONFIG_PREFIX + name.upper(): str(getattr(self.config, name)) for name in shown}
        )
        if self.config.cp_size > 1:
            out[env_vars.PARALLELISM_CONFIG_PREFIX + "CP_BACKEND"] = self.config.cp_backend
        if self.config.pp_size > 1:
            out[env_vars.PARALLELISM_CONFIG_PREFIX + "PP_SCHEDULE"] = self.config.pp_schedule
            if self.config.pp_microbatches is not None:
                out[env_vars.PARALLELISM_CONFIG_PREFIX + "PP_MICROBATCHES"] = str(self.config.pp_microbatches)
        return out

    @property
    def plain(self) -> bool:
        """Every size 1 (or only replicas): plain data parallelism, nothing for the processes to build."""
        return self.config.dp_replicate_size == self.config.total_size

    def line(self) -> str:
        """The dry run's line, e.g. ``mesh: dp_shard 2 x tp 2 (2 data-parallel ranks; from ...)``."""
        ranks = data_parallel_ranks(self.config)
        how = "plain data parallelism, accelerate's rule for sizes all 1; " if self.plain else ""
        cp = ""
        if self.config.cp_size > 1:
            used = resolve_backend(self.config.cp_backend, self.device)
            chosen = f" ({self.config.cp_backend})" if self.config.cp_backend != used else ""
            cp = f"; context-parallel attention {used}{chosen}"
        if self.config.pp_size > 1:
            cp += f"; pipeline {pipeline_text(self.config)}"
        return (
            f"mesh: {mesh_text(self.config)} ({how}{ranks} data-parallel rank{'s' * (ranks > 1)}{cp}; {self.source})"
        )


def launch_sizes(s: Settings) -> dict[str, int | None]:
    """The sizes the launch settings give (None: not given)."""
    return {name: s[name] for name in SIZES}


def _given_source(s: Settings) -> str:
    """Where the sizes came from: those above 1 (all given ones when every size is 1)."""
    names = [name for name in SIZES if s[name] is not None and s[name] > 1]
    names = names or [name for name in SIZES if s[name] is not None]
    return ", ".join(f"{name} from {s.sources[name]}" for name in names)


def check_sizes(
    sizes: dict[str, Any],
    world_size: int,
    deepspeed: Any,
    source: str,
    cp_backend: str | None = None,
    device: str = "cpu",
    pp_schedule: str | None = None,
    pp_microbatches: int | None = None,
) -> ParallelismConfig | None:
    """The configuration of ``sizes``, ``cp_backend`` and the pipeline's ``pp_schedule`` and ``pp_microbatches``
    fitted to ``world_size``; None when no size was given. ConfigError (one line) for sp above 1, sizes that do not
    multiply to ``world_size``, tensor, context or pipeline parallelism with DeepSpeed, a context-parallel backend
    ``device`` cannot run."""
    if all(value is None for value in sizes.values()):
        return None
    config = fitted(parallelism_from_sizes(sizes, cp_backend, pp_schedule, pp_microbatches), world_size)
    for name, what in (("tp_size", "tensor"), ("cp_size", "context"), ("pp_size", "pipeline")):
        size = getattr(config, name)
        if size > 1 and deepspeed:
            raise ConfigError(
                f"{name} {size} ({source}) with DeepSpeed: {what} parallelism runs on FSDP2 or alone; drop "
                f"--deepspeed (use --dp_shard_size to shard the rest) or set {name} 1"
            )
    if config.cp_size > 1:
        resolve_backend(config.cp_backend, device)
    return config


def parallel_problems(s: Settings) -> list[str]:
    """What the launch settings alone get wrong about the sizes (for ``launch`` and ``config validate``)."""
    try:
        check_sizes(
            launch_sizes(s),
            s.world_size,
            s["deepspeed"],
            _given_source(s),
            s["cp_backend"],
            s["device"] or "cpu",
            *_pipeline(s),
        )
    except ConfigError as error:
        return [str(error)]
    return []


def plan_for_script(s: Settings) -> ParallelPlan | None:
    """The launch's sizes for a script or module; None when none was given."""
    device = s["device"] or "cpu"
    config = check_sizes(
        launch_sizes(s), s.world_size, s["deepspeed"], _given_source(s), s["cp_backend"], device, *_pipeline(s)
    )
    return None if config is None else ParallelPlan(config, _given_source(s), device=device)


def _pipeline(s: Settings) -> tuple[str | None, int | None]:
    """The launch's pipeline schedule and microbatches (None: not given)."""
    return s["pp_schedule"], s["pp_microbatches"]


def plan_for_train(s: Settings, user_args: Sequence[str]) -> ParallelPlan | None:
    """The sizes ``train`` runs with: its own flags' where it sets any (the launch's are then not passed on, with a
    note), else the launch's, passed as flags; checked against the world, DeepSpeed, the device and the model's
    config. ``--cp_backend``, ``--pp_schedule`` and ``--pp_microbatches`` likewise: the train arguments' own when they
    set them, else the launch's."""
    user = train_sources(user_args)
    own = [name for name in TRAIN_SIZES if name in user]
    launched = launch_sizes(s)
    notes: list[str] = []
    options = ("cp_backend", *PIPELINE_OPTIONS)
    read = own or "parallelism_config" in user or any(name in user for name in options)
    values = _train_values(user_args) if read else {}
    chosen = {name: values.get(name) if name in user else s[name] for name in options}
    if own or "parallelism_config" in user:
        sizes = {name: values.get(name) for name in TRAIN_SIZES}
        shown = [name for name in own if (sizes[name] or 1) > 1] or own
        source = ", ".join(f"{name} from {user[name]}" for name in shown) or user["parallelism_config"]
        if any(value is not None for value in launched.values()):
            what = own[0] if own else "parallelism_config"
            notes.append(f"{_given_source(s)} not passed on: the train arguments set {what} (your train flags win)")
        flags: list[str] = []
    else:
        sizes, source = launched, _given_source(s)
        # sp_size is no train flag: above 1 it is refused below, and 1 means nothing
        flags = [
            word for name in TRAIN_SIZES if launched[name] is not None for word in (f"--{name}", str(launched[name]))
        ]
        for name in options:
            if s[name] is not None and name not in user and flags:
                flags += [f"--{name}", str(s[name])]
    deepspeed = s["deepspeed"] or "deepspeed" in train_sources(user_args)
    device = s["device"] or "cpu"
    config = check_sizes(
        sizes,
        s.world_size,
        deepspeed,
        source,
        chosen["cp_backend"],
        device,
        chosen["pp_schedule"],
        chosen["pp_microbatches"],
    )
    if config is None:
        return None
    if config.tp_size > 1 or config.cp_size > 1 or config.pp_size > 1:
        notes += check_train_model(user_args, config.tp_size, config.cp_size, pipeline_stages(config))
    return ParallelPlan(config, source, flags, notes, device)


def _train_values(args: Sequence[str]) -> dict[str, Any]:
    """The user's train flag values, ``--config`` files applied (the train job's own parser; seconds)."""
    from trainer_ext.job.flags import parse_train_values

    return parse_train_values(args)[0]


def check_train_model(args: Sequence[str], tp_size: int, cp_size: int = 1, pp_stages: int = 1) -> list[str]:
    """ConfigError when the train job's model cannot be split over ``tp_size`` ranks, its sequences over ``cp_size``
    or its layers into ``pp_stages`` pipeline stages; notes when its config cannot be read here (a hub id: checked
    when the model is built)."""
    from trainer_ext.job.parallel import check_job_model

    return check_job_model(_train_values(args), tp_size, cp_size, pp_stages)
