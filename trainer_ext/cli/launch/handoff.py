"""What the launcher hands to the training code: precision, accumulation, CPU and DeepSpeed/FSDP settings.

For ``train`` they become TrainingArguments flags, unless the user's train arguments (or the ``--config``
files among them) already set the same thing: the user's own train flags win, and the dry run says so.
When ``train`` gets a DeepSpeed config, :func:`preview_deepspeed` resolves its ``"auto"`` values from what
those processes will see, so the launcher reports conflicts and shows the result before anything starts.
A user script gets environment variables instead (named in :mod:`trainer_ext.env_vars`):
``ACCELERATE_MIXED_PRECISION`` (transformers' TrainingArguments reads it into ``args.mixed_precision``, which
our engine uses) and ``TRAINER_EXT_GRADIENT_ACCUMULATION_STEPS`` (the script reads it itself).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from trainer_ext import env_vars
from trainer_ext.cli.launch.target import Target
from trainer_ext.config_files import load_mapping
from trainer_ext.errors import ConfigError

if TYPE_CHECKING:
    from trainer_ext.cli.launch.settings import Settings


def _config_keys(path: str) -> set[str]:
    """Keys of a ``trainer-ext train --config`` file; empty when unreadable (train reports that itself)."""
    try:
        data = load_mapping(path, "train --config")
    except ConfigError:
        return set()
    return {str(k).replace("-", "_") for k in data}


def train_sources(args: Sequence[str]) -> dict[str, str]:
    """Flags the user's ``train`` arguments set, their ``--config`` files included: name -> where it is set."""
    flags: dict[str, str] = {}
    files: dict[str, str] = {}
    for i, word in enumerate(args):
        if not word.startswith("--"):
            continue
        name, eq, value = word[2:].partition("=")
        name = name.replace("-", "_")
        flags[name.removeprefix("no_")] = f"train --{name}"
        if name == "config":
            path = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            files.update(dict.fromkeys(_config_keys(path), f"train --config {path}"))
    return {**files, **flags}  # flags win over files, a later file over an earlier one


def train_flags_set(args: Sequence[str]) -> set[str]:
    """Names of the flags the user's ``train`` arguments set, their ``--config`` files included."""
    return set(train_sources(args))


def translate_for_train(
    s: Settings, target: Target, notes: list[str], strategy: bool = True
) -> tuple[Target, dict[str, str]]:
    """``target`` with the launch settings appended as train flags, and the environment to add."""
    user = train_flags_set(target.args)
    extra: list[str] = []
    env: dict[str, str] = {}

    def add(setting: str, flags: list[str], clashes: set[str]) -> bool:
        clash = sorted(clashes & user)
        if clash:
            notes.append(
                f"{setting} from {s.sources[setting]} not passed on: the train arguments already set --{clash[0]} "
                "(your train flags win)"
            )
            return False
        extra.extend(flags)
        return True

    if s["cpu"] and s.given("cpu"):
        add("cpu", ["--use_cpu"], {"use_cpu"})
    mode = s["mixed_precision"]
    if mode in ("bf16", "fp16", "fp8"):
        add("mixed_precision", [f"--{mode}"], {"bf16", "fp16", "fp8"})
    steps = s["gradient_accumulation_steps"]
    if steps is not None:
        add(
            "gradient_accumulation_steps",
            ["--gradient_accumulation_steps", str(steps)],
            {"gradient_accumulation_steps"},
        )
    if not strategy:
        _strategy_ignored(s, notes)
    elif s["deepspeed"]:
        config = s["deepspeed"]
        value = config if isinstance(config, str) else json.dumps(config, sort_keys=True)
        add("deepspeed", ["--deepspeed", value], {"deepspeed"})
    elif s["fsdp_config"]:
        config = s["fsdp_config"]
        value = config if isinstance(config, str) else json.dumps(config, sort_keys=True)
        add("fsdp_config", ["--fsdp", s["fsdp"] or "full_shard", "--fsdp_config", value], {"fsdp", "fsdp_config"})
    return Target(target.kind, target.name, [*target.args, *extra]), env


def translate_for_script(s: Settings, target: Target, notes: list[str], strategy: bool = True) -> dict[str, str]:
    """The environment variables that carry the launch settings into a user script or module."""
    env: dict[str, str] = {}
    if s["cpu"] and s.given("cpu"):
        env[env_vars.CUDA_VISIBLE_DEVICES] = ""  # any script then runs on the CPU
    if s.given("mixed_precision"):
        env[env_vars.MIXED_PRECISION] = s["mixed_precision"]
    if s["gradient_accumulation_steps"] is not None:
        name = env_vars.GRADIENT_ACCUMULATION_STEPS
        env[name] = str(s["gradient_accumulation_steps"])
        notes.append(
            f"{target.name} must read {name} itself, e.g. "
            f"TrainingArguments(gradient_accumulation_steps=int(os.environ.get('{name}', 1)))"
        )
    if not strategy:
        _strategy_ignored(s, notes)
    elif s["deepspeed"]:
        config = s["deepspeed"]
        _check_deepspeed_file(config)
        env[env_vars.DEEPSPEED_CONFIG] = config if isinstance(config, str) else json.dumps(config, sort_keys=True)
        notes.append(
            f"deepspeed from {s.sources['deepspeed']}: {env_vars.DEEPSPEED_CONFIG} is set; a TrainingArguments or "
            "Accelerator in the script that names no DeepSpeed config (or FSDP) of its own trains with it"
        )
    elif s["fsdp_config"]:
        notes.append(
            f"fsdp_config from {s.sources['fsdp_config']}: {env_vars.FSDP_CONFIG} is set; a TrainingArguments or "
            "Accelerator in the script that names no FSDP settings (or DeepSpeed) of its own trains with them"
        )
    return env


def _check_deepspeed_file(config: Any) -> None:
    """Read and check the config before any process starts (a bad file is a launch error, exit 2)."""
    from trainer_ext.distributed.strategies.deepspeed.config import load_deepspeed_config

    load_deepspeed_config(config)


def _strategy_ignored(s: Settings, notes: list[str]) -> None:
    for name in ("deepspeed", "fsdp_config", "dp_replicate_size", "dp_shard_size", "tp_size"):
        if s[name]:
            notes.append(f"{name} from {s.sources[name]} is ignored: the self-test checks plain data parallelism")


# the TrainingArguments that "auto" values in a DeepSpeed config are taken from (phase 1)
_DS_BASIC = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "bf16", "fp16")
_DS_OPTIMIZER = ("learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay")
_LAUNCH_SETTING = {"bf16": "mixed_precision", "fp16": "mixed_precision", "fp8": "mixed_precision", "use_cpu": "cpu"}


@dataclass
class DeepSpeedPreview:
    """The DeepSpeed config ``train`` will get, after phase-1 ``"auto"`` resolution, and what it came from."""

    source: str
    config: dict
    inputs: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def preview_deepspeed(s: Settings, user_args: Sequence[str], train_args: Sequence[str]) -> DeepSpeedPreview | None:
    """Phase-1 resolution of the DeepSpeed config that ``train_args`` give ``train`` on ``s.world_size`` processes.

    None without a DeepSpeed config. Malformed JSON, invalid settings and explicit values contradicting
    the train arguments raise the ConfigError ``train`` itself would raise, before any process starts.
    """
    if "deepspeed" not in train_flags_set(train_args):
        return None
    from trainer_ext.distributed.strategies.deepspeed.config import DeepSpeedConfig, DeepSpeedInputs, auto_keys
    from trainer_ext.job.arguments import AUTO_DEFAULTS
    from trainer_ext.job.flags import parse_train_values

    values = parse_train_values(train_args)[0]  # unknown flags are left for train to report
    if not values.get("deepspeed"):
        return None
    job = "scratch" if values.get("model_name_or_path") is None else "pretrained"
    defaults = {k: v for k, v in AUTO_DEFAULTS[job].items() if values.get(k) is None}
    values.update(defaults)  # what TrainJobArguments fills in for this kind of job
    user, launched = train_sources(user_args), train_flags_set(train_args[len(user_args) :])

    def source(name: str) -> str:
        if name in user:
            return user[name]
        if name in launched:
            setting = _LAUNCH_SETTING.get(name, name)
            return f"launch {setting} ({s.sources[setting]})"
        if name in defaults:
            return f"default for a {'model from scratch' if job == 'scratch' else 'pretrained model'}"
        return "TrainingArguments default"

    inputs = DeepSpeedInputs.from_training_args(SimpleNamespace(**values), world_size=s.world_size)
    path = values["deepspeed"]
    inline = not isinstance(path, str) or path.lstrip().startswith("{")
    where = f"inline in {source('deepspeed')}" if inline else path
    config = DeepSpeedConfig(path, source=where).resolve(inputs).config

    machines = s["num_machines"]
    used = [f"world size {s.world_size}: {s['nproc_per_node']} process(es) per machine x {machines} machine(s)"]
    names = list(_DS_BASIC)
    names += _DS_OPTIMIZER if "optimizer" in config else ["learning_rate"] if "scheduler" in config else []
    used += [f"{name} {_show(values[name])}: {source(name)}" for name in names]
    notes = []
    left = sorted(auto_keys(config))
    if left:
        notes.append(
            f'DeepSpeed keys still "auto" until training starts (from the model\'s hidden size and the schedule): '
            f"{', '.join(left)}"
        )
    if importlib.util.find_spec("deepspeed") is None:
        notes.append("deepspeed is not installed here; train will stop: pip install 'deepspeed>=0.16'")
    return DeepSpeedPreview(where, config, used, notes)


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
