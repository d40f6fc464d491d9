"""The FSDP settings ``train`` will start with, checked by the launcher and ``config validate`` before any process.

Without this, a bad FSDP config (an unknown key, ``NO_SHARD``, one process) passed every launch check and then
failed on every rank. :func:`preview_fsdp` parses what ``train`` will parse (``--fsdp`` and ``--fsdp_config``,
from the launch settings or the user's own train flags) with the same code as TrainingArguments.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from .launch_settings import Settings

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

    def lines(self) -> list[str]:
        """The dry-run block: one ``name: value`` line per setting."""
        rows = [f"FSDP2 settings from {self.source}, as train will apply them (fully_shard):"]
        for name, value in self.settings.items():
            shown = _UNSET.get(name, "-") if value is None else value
            rows.append(f"  {name}: {str(shown).lower() if isinstance(shown, bool) else shown}")
        return rows


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.into:
            self.into.append(message)


@contextmanager
def _warnings_into(notes: list[str]) -> Iterator[None]:
    """The FSDP parser's warnings (FSDP1-only keys ignored) become dry-run notes instead of stray log lines."""
    from ..distributed import fsdp_config

    handler = _Collect(notes)
    fsdp_config.logger.addHandler(handler)
    propagate, fsdp_config.logger.propagate = fsdp_config.logger.propagate, False
    try:
        yield
    finally:
        fsdp_config.logger.removeHandler(handler)
        fsdp_config.logger.propagate = propagate


def check_fsdp(fsdp: Any, config: str | dict | None, world_size: int, source: str) -> FSDPPreview:
    """Parse ``--fsdp``/``--fsdp_config`` as TrainingArguments will on ``world_size`` processes.

    One ConfigError naming ``source`` and every problem: one process (FSDP needs at least 2), each unknown
    key or bad value of the config, ``NO_SHARD``.
    """
    from ..distributed.fsdp_config import parse_fsdp, read_fsdp_config
    from ..distributed.rules import check_world

    notes: list[str] = []
    problems: list[str] = []

    def attempt(check: Callable[..., Any], *args: Any) -> Any:
        try:
            return check(*args)
        except ConfigError as error:
            problems.append(str(error))
            return None

    with _warnings_into(notes):
        attempt(check_world, world_size, "fsdp")
        for key, value in (attempt(read_fsdp_config, config) or {}).items():
            attempt(
                parse_fsdp, True, {key: value}
            )  # one key at a time: a file with several mistakes is reported whole
        settings = None if problems else attempt(parse_fsdp, fsdp, config)  # with the --fsdp words, as train will
    if settings is None:
        raise ConfigError(f"FSDP settings from {source}: {'; '.join(p.rstrip('.') for p in problems)}")
    return FSDPPreview(source, settings.to_dict(), notes)


def preview_fsdp(s: Settings, user_args: Sequence[str], train_args: Sequence[str]) -> FSDPPreview | None:
    """The FSDP settings ``train_args`` give ``train`` on ``s.world_size`` processes; None without ``--fsdp``."""
    from ..flags import parse_train_values
    from ..training_args import _fsdp_requested
    from .launch_train_args import train_flags_set, train_sources

    if not {"fsdp", "fsdp_config"} & train_flags_set(train_args):
        return None
    values = parse_train_values(train_args)[0]  # unknown flags are left for train to report
    if not _fsdp_requested(values.get("fsdp")):
        return None
    user = train_sources(user_args)
    if "fsdp_config" in user:
        source = user["fsdp_config"]
    elif s["fsdp_config"] is not None:
        source = s.sources["fsdp_config"]
    else:
        source = f"{user.get('fsdp', 'train --fsdp')} (no fsdp_config)"
    return check_fsdp(values["fsdp"], values.get("fsdp_config"), s.world_size, source)


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
