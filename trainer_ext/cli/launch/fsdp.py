"""The FSDP settings ``train`` will start with, checked by the launcher and ``config validate`` before any process.

Without this, a bad FSDP config (an unknown key, ``NO_SHARD``) passed every launch check and then
failed on every rank. :func:`preview_fsdp` parses what ``train`` will parse (``--fsdp`` and ``--fsdp_config``,
from the launch settings or the user's own train flags) with the same code as TrainingArguments.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer_ext.cli.launch.handoff import train_flags_set, train_sources
from trainer_ext.errors import ConfigError

if TYPE_CHECKING:
    from trainer_ext.cli.launch.settings import Settings
    from trainer_ext.cli.launch.target import Target

# what a None value of an FSDPSettings field means, for the dry run
_UNSET = {
    "transformer_layer_cls_to_wrap": "the model's _no_split_modules",
    "replicate_size": "the number of machines",
    "param_dtype": "from --bf16/--fp16, else float32",
    "reduce_dtype": "float32",
}


@dataclass
class FSDPPreview:
    """The FSDP2 settings ``train`` will apply, where the config came from, and warnings met while reading it."""

    source: str
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    applied_by: str = "train"

    def exported(self) -> str:
        """The settings as ``TRAINER_EXT_FSDP_CONFIG`` carries them to a script (unset values left out)."""
        return json.dumps({k: v for k, v in self.settings.items() if v is not None}, sort_keys=True)

    def lines(self) -> list[str]:
        """The dry-run block: one ``name: value`` line per setting."""
        rows = [f"FSDP2 settings from {self.source}, as {self.applied_by} will apply them (fully_shard):"]
        for name, value in self.settings.items():
            shown = _UNSET.get(name, "-") if value is None else value
            rows.append(f"  {name}: {str(shown).lower() if isinstance(shown, bool) else shown}")
        return rows


def check_fsdp(fsdp: Any, config: str | dict | None, world_size: int, source: str) -> FSDPPreview:
    """Parse ``--fsdp``/``--fsdp_config`` as TrainingArguments will on ``world_size`` processes.

    One ConfigError naming ``source`` and every problem: the processes FSDP cannot run on, each unknown key or
    bad value of the config, ``NO_SHARD``.
    """
    from trainer_ext.distributed.rules import check_world
    from trainer_ext.distributed.strategies.fsdp.config import read_fsdp_config, read_fsdp_settings

    problems: list[str] = []

    def attempt(check: Callable[..., Any], *args: Any) -> Any:
        try:
            return check(*args)
        except ConfigError as error:
            problems.append(str(error))
            return None

    attempt(check_world, world_size, "fsdp")
    for key, value in (attempt(read_fsdp_config, config) or {}).items():
        attempt(read_fsdp_settings, True, {key: value})  # one key at a time: every mistake of a file is reported
    parsed = None if problems else attempt(read_fsdp_settings, fsdp, config)  # with the --fsdp words, as train will
    if parsed is None:
        raise ConfigError(f"FSDP settings from {source}: {'; '.join(p.rstrip('.') for p in problems)}")
    settings, warnings = parsed
    return FSDPPreview(source, settings.to_dict(), warnings)  # warnings (FSDP1-only keys ignored) become notes


def preview_fsdp(s: Settings, user_args: Sequence[str], train_args: Sequence[str]) -> FSDPPreview | None:
    """The FSDP settings ``train_args`` give ``train`` on ``s.world_size`` processes; None without ``--fsdp``."""
    from trainer_ext.distributed.strategies.fsdp.config import fsdp_requested
    from trainer_ext.job.flags import parse_train_values

    if not {"fsdp", "fsdp_config"} & train_flags_set(train_args):
        return None
    values = parse_train_values(train_args)[0]  # unknown flags are left for train to report
    if not fsdp_requested(values.get("fsdp")):
        return None
    user = train_sources(user_args)
    if "fsdp_config" in user:
        source = user["fsdp_config"]
    elif s["fsdp_config"] is not None:
        source = s.sources["fsdp_config"]
    else:
        source = f"{user.get('fsdp', 'train --fsdp')} (no fsdp_config)"
    return check_fsdp(values["fsdp"], values.get("fsdp_config"), s.world_size, source)


def script_fsdp(s: Settings) -> FSDPPreview | None:
    """The launch's FSDP settings for a script or module (``TRAINER_EXT_FSDP_CONFIG``), checked before any process
    starts; None without ``fsdp_config``."""
    if not s["fsdp_config"]:
        return None
    preview = check_fsdp(s["fsdp"] or True, s["fsdp_config"], s.world_size, s.sources["fsdp_config"])
    preview.applied_by = "the script's TrainingArguments or Accelerator"
    return preview


def runs_fsdp(target: Target, preview: FSDPPreview | None) -> bool:
    """Whether the launched job trains under FSDP: ``train`` with FSDP settings, a script or module given the
    launch's (``preview``), or one given an ``--fsdp`` value among its own arguments (transformers' flag, as
    HfArgumentParser scripts take it)."""
    from trainer_ext.distributed.strategies.fsdp.config import fsdp_requested

    if preview is not None:
        return True
    if target.kind == "train":
        return False
    args = list(target.args)
    for i, word in enumerate(args):
        name, eq, value = word.partition("=")
        if name != "--fsdp":
            continue
        following = args[i + 1] if i + 1 < len(args) else None
        if not eq:  # --fsdp WORDS, or a bare --fsdp (a bool flag in some scripts)
            value = following if following is not None and not following.startswith("--") else True
        if fsdp_requested(value):
            return True
    return False


def fsdp_problems(s: Settings) -> list[str]:
    """For ``config validate``: what ``launch ... train`` would refuse in the file's FSDP settings."""
    config = s["fsdp_config"]
    if config is None or (isinstance(config, str) and not os.path.isfile(os.path.expanduser(config))):
        return []  # no FSDP, or a missing file (already a problem of its own)
    try:
        check_fsdp(s["fsdp"] or True, config, s.world_size, s.sources["fsdp_config"])
    except ConfigError as error:
        return [str(error)]
    return []
