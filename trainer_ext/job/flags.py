"""Flags and config files into TrainJobArguments, below the CLI that calls it: files first, flags over them.

Precedence, lowest to highest: transformers' defaults < our automatic defaults (see
``trainer_ext.job.arguments.AUTO_DEFAULTS``) < ``--config`` files in the order given < command-line flags.
``--a-b`` and ``--a_b`` are the same flag; an unknown flag or config key is an error naming the closest valid
names. Every failure is a ConfigError, so the CLI can report it in one line.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from transformers import HfArgumentParser

from trainer_ext.config_files import load_mapping
from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.job.arguments import TrainJobArguments, field_names, normalize_keys
from trainer_ext.job.flag_help import HELP_ALL, render
from trainer_ext.job.flag_spec import (
    CONFIG_SUFFIXES,
    spec_flags,
    spec_from_parser,
    stray_word_error,
    unknown_flag_error,
    write_shipped,
)


class _RaiseOnError:
    """Argparse mixin: errors raise ConfigError instead of printing usage and exiting the process."""

    def error(self, message: str) -> None:
        raise ConfigError(message)


class _Parser(_RaiseOnError, HfArgumentParser):
    """HfArgumentParser that raises ConfigError and prints the grouped help of ``trainer_ext.job.flag_help``."""

    def format_help(self) -> str:
        return render(spec_flags(spec_from_parser(self)), everything=self._help_all)

    _help_all = False


class _HelpAll(argparse.Action):
    """``--help_all``: every flag, transformers' long tail included."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        parser._help_all = True
        parser.print_help()
        parser.exit()


class _PreParser(_RaiseOnError, argparse.ArgumentParser):
    """Finds the --config files before the real parse."""


def build_parser(prog: str = "trainer-ext train") -> HfArgumentParser:
    """The parser for every TrainJobArguments field, plus ``--config``."""
    parser = _Parser(
        TrainJobArguments,
        prog=prog,
        allow_abbrev=False,  # a prefix of a flag must not silently pick some other flag
        description="Fine-tune or train a model. With no arguments, trains a small classifier on shipped data.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        action="append",
        help="YAML or JSON file of flag values (keys are flag names). Flags on the command line override it; "
        "with several files the later one wins.",
    )
    parser.add_argument(HELP_ALL, action=_HelpAll, help="show every flag, transformers' long tail included")
    return parser


def load_config_file(path: str) -> dict[str, Any]:
    """The key/value mapping in a YAML or JSON config file, keys normalised; ConfigError on any problem."""
    values = load_mapping(path, "--config", suffixes=CONFIG_SUFFIXES)
    return normalize_keys(values, field_names(), f"config file {path!r}")


def _coerce(action: argparse.Action, value: Any, source: str) -> Any:
    """Convert a config value with the flag's own type so a file and the command line mean the same."""
    name = action.dest
    if value is None or isinstance(value, (bool, dict)) or action.type is None:
        return value
    many = action.nargs in ("+", "*")
    if isinstance(value, list):
        if not many:
            return value  # a list where a flag takes one string (e.g. report_to): the dataclass accepts it
        return [_coerce_one(action, item, name, source) for item in value]
    converted = _coerce_one(action, value, name, source)
    return [converted] if many else converted


def _coerce_one(action: argparse.Action, value: Any, name: str, source: str) -> Any:
    if action.type is int and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{name}: {value!r} in {source} is not a whole number")
    try:
        converted = action.type(str(value) if not isinstance(value, (int, float)) else value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
        raise ConfigError(f"{name}: cannot read {value!r} in {source}: {error}") from error
    if action.choices is not None and converted not in action.choices:
        choices = [str(c) for c in action.choices]
        raise ConfigError(
            f"{name}: {value!r} in {source} is not one of {', '.join(choices)}.{did_you_mean(str(value), choices)}"
        )
    return converted


def _unknown_flag_error(
    extras: Sequence[str], parser: argparse.ArgumentParser, command: str = "train", more_flags: Sequence[str] = ()
) -> ConfigError:
    """A ConfigError naming the first unknown flag (or stray word) and the closest valid flags (the parser's and
    ``more_flags``, those of a ``command`` that takes train's flags and its own)."""
    flags = [word for word in extras if word.startswith("-")]
    if not flags:
        return stray_word_error(extras[0])
    valid = [s for a in parser._actions for s in a.option_strings] + [f"--{m}" for m in more_flags]
    return unknown_flag_error(flags[0].split("=", 1)[0], valid, command)


def parse_train_values(argv: Sequence[str]) -> tuple[dict[str, Any], list[str], argparse.ArgumentParser]:
    """The flag values of ``trainer-ext train`` arguments, ``--config`` files applied, without building anything;
    also the words no flag took and the parser."""
    argv = list(argv)
    pre = _PreParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", action="append", default=[])
    found, _ = pre.parse_known_args(argv)

    parser = build_parser()
    actions = {a.dest: a for a in parser._actions if not isinstance(a, argparse._StoreFalseAction)}
    defaults: dict[str, Any] = {}
    for path in found.config:
        source = f"config file {path!r}"
        defaults.update({k: _coerce(actions[k], v, source) for k, v in load_config_file(path).items()})
    parser.set_defaults(**defaults)

    namespace, extras = parser.parse_known_args(argv)
    return {k: v for k, v in vars(namespace).items() if k != "config"}, extras, parser


def parse_train_args(argv: Sequence[str]) -> TrainJobArguments:
    """Parse ``trainer-ext train`` arguments (with ``--config`` files) into validated TrainJobArguments."""
    values, extras, parser = parse_train_values(argv)
    if extras:
        raise _unknown_flag_error(extras, parser)
    return TrainJobArguments(**values)


if __name__ == "__main__":  # after a flag changed: rewrite the shipped flag spec that --help and the CLI's checks read
    print(f"wrote {write_shipped(build_parser())}")
