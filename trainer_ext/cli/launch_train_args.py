"""What the launcher hands to the training code: precision, accumulation, CPU and DeepSpeed/FSDP settings.

For ``train`` they become TrainingArguments flags, unless the user's train arguments (or the ``--config``
files among them) already set the same thing: the user's own train flags win, and the dry run says so.
A user script gets environment variables instead: ``ACCELERATE_MIXED_PRECISION`` (transformers'
TrainingArguments reads it into ``args.mixed_precision``, which our engine uses) and
``TRAINER_EXT_GRADIENT_ACCUMULATION_STEPS`` (the script reads it itself).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from .launch import Target
    from .launch_settings import Settings

ENV_ACCUMULATION = "TRAINER_EXT_GRADIENT_ACCUMULATION_STEPS"
ENV_PRECISION = "ACCELERATE_MIXED_PRECISION"


def _config_keys(path: str) -> set[str]:
    """Keys of a ``trainer-ext train --config`` file; empty when unreadable (train reports that itself)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):
        return set()
    return {str(k).replace("-", "_") for k in data} if isinstance(data, dict) else set()


def train_flags_set(args: Sequence[str]) -> set[str]:
    """Names of the flags the user's ``train`` arguments set, their ``--config`` files included."""
    names: set[str] = set()
    for i, word in enumerate(args):
        if not word.startswith("--"):
            continue
        name, eq, value = word[2:].partition("=")
        name = name.replace("-", "_")
        names.add(name.removeprefix("no_"))
        if name == "config":
            path = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            names |= _config_keys(path)
    return names


def translate_for_train(
    s: Settings, target: Target, notes: list[str], strategy: bool = True
) -> tuple[Target, dict[str, str]]:
    """``target`` with the launch settings appended as train flags, and the environment to add."""
    from .launch import Target

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
        add("deepspeed", ["--deepspeed", str(s["deepspeed"])], {"deepspeed"})
    elif s["fsdp_config"]:
        config = s["fsdp_config"]
        value = config if isinstance(config, str) else json.dumps(config, sort_keys=True)
        add("fsdp_config", ["--fsdp", s["fsdp"] or "full_shard", "--fsdp_config", value], {"fsdp", "fsdp_config"})
    return Target(target.kind, target.name, [*target.args, *extra]), env


def translate_for_script(s: Settings, target: Target, notes: list[str], strategy: bool = True) -> dict[str, str]:
    """The environment variables that carry the launch settings into a user script or module."""
    env: dict[str, str] = {}
    if s["cpu"] and s.given("cpu"):
        env["CUDA_VISIBLE_DEVICES"] = ""  # any script then runs on the CPU
    if s.given("mixed_precision"):
        env[ENV_PRECISION] = s["mixed_precision"]
    if s["gradient_accumulation_steps"] is not None:
        env[ENV_ACCUMULATION] = str(s["gradient_accumulation_steps"])
        notes.append(
            f"{target.name} must read {ENV_ACCUMULATION} itself, e.g. "
            f"TrainingArguments(gradient_accumulation_steps=int(os.environ.get('{ENV_ACCUMULATION}', 1)))"
        )
    if not strategy:
        _strategy_ignored(s, notes)
    return env


def _strategy_ignored(s: Settings, notes: list[str]) -> None:
    for name in ("deepspeed", "fsdp_config"):
        if s[name]:
            notes.append(f"{name} from {s.sources[name]} is ignored: the self-test checks plain data parallelism")


def strategy_problems(s: Settings, target: Target | None, strategy: bool = True) -> list[str]:
    """DeepSpeed/FSDP settings are turned into flags for ``train`` only; a script must take them itself."""
    if not strategy or target is None or target.kind == "train":
        return []
    return [
        f"{name} ({s.sources[name]}) is passed on only to `trainer-ext launch ... train`; for {target.name}, give "
        f"the file to your own TrainingArguments (e.g. --{'deepspeed' if name == 'deepspeed' else 'fsdp_config'} "
        "FILE among its arguments) and launch without it"
        for name in ("deepspeed", "fsdp_config")
        if s[name]
    ]
