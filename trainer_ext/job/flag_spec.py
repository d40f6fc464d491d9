"""The flags of ``trainer-ext train`` as data, so that ``--help`` and bad input answer before torch is imported.

The flags come from ``TrainJobArguments`` through transformers' ``HfArgumentParser``, which needs torch and
transformers (seconds under load). A spec of them — each flag's names, type, choices, default and help — ships in
``job/builtin_data/train_flags.json``, keyed by the transformers version and a hash of our arguments' source files; when
the key does not match (another transformers, an edited checkout) the spec is rebuilt from the parser once and kept
in the user's cache folder. ``tests/test_flag_spec.py`` checks the shipped file is current; after a flag changes,
``python -m trainer_ext.job.flags`` rewrites it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from trainer_ext.errors import ConfigError, closest

SHIPPED = Path(__file__).parent / "builtin_data" / "train_flags.json"
PACKAGE = Path(__file__).resolve().parent.parent
# the modules whose dataclass fields are the flags (their text is hashed into the spec's key)
SOURCES = (
    "job/arguments.py",
    "job/fields.py",
    "trainer/training_args.py",
    "job/lora_arguments.py",
    "job/metrics_arguments.py",
    "job/flag_spec.py",
)
CACHE_DIR_ENV = "TRAINER_EXT_CACHE_DIR"
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
# the words transformers' string_to_bool reads as true and as false
TRUE_WORDS = ("yes", "true", "t", "y", "1")
FALSE_WORDS = ("no", "false", "f", "n", "0")


@dataclass(frozen=True)
class Flag:
    """One destination of the parser: its option strings, how many values it takes and what they may be."""

    dest: str
    options: tuple[str, ...]
    kind: str  # "int", "float", "bool", "str", "other" (checked by the real parser only), "switch" (no value)
    nargs: str | None
    choices: tuple[str, ...] | None
    default: Any
    help: str
    negative: tuple[str, ...] = ()  # --no_x for a bool that defaults to True

    @property
    def name(self) -> str:
        return self.options[0]


def spec_key() -> dict[str, str]:
    """What the flags depend on: transformers' version and our arguments' source text."""
    digest = hashlib.sha256()
    for name in SOURCES:
        try:
            digest.update((PACKAGE / name).read_bytes())
        except OSError:
            digest.update(name.encode())
    try:
        transformers_version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers_version = "missing"
    return {"transformers": transformers_version, "sources": digest.hexdigest()[:16]}


def _kind(action: Any) -> str:
    if not action.option_strings or action.nargs == 0:
        return "switch"
    kind = getattr(action.type, "__name__", "")
    return {"int": "int", "float": "float", "str": "str", "string_to_bool": "bool"}.get(kind, "other")


def _plain(value: Any) -> Any:
    """A JSON value for a default (enums by value, anything else unusual as text)."""
    value = getattr(value, "value", value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def spec_from_parser(parser: Any) -> dict[str, Any]:
    """The spec of an argparse parser (``flags.build_parser()``): one entry per destination, in the parser's order."""
    entries: dict[str, dict[str, Any]] = {}
    for action in parser._actions:
        if action.dest in ("help", "==SUPPRESS==") or not action.option_strings:
            continue
        if action.const is False and action.nargs == 0 and action.dest in entries:  # HfArgumentParser's --no_x
            entries[action.dest]["negative"] = list(action.option_strings)
            continue
        entries[action.dest] = {
            "dest": action.dest,
            "options": list(action.option_strings),
            "kind": _kind(action),
            "nargs": action.nargs if isinstance(action.nargs, str) else None,
            "choices": [str(_plain(c)) for c in action.choices] if action.choices else None,
            "default": _plain(action.default),
            "help": " ".join((action.help or "").split()),
        }
    return {"key": spec_key(), "flags": list(entries.values())}


def _cache_file(key: dict[str, str]) -> Path:
    base = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trainer_ext"
    )
    return Path(base) / f"train_flags-{key['transformers']}-{key['sources']}.json"


def _read(path: Path, key: dict[str, str]) -> dict[str, Any] | None:
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return spec if isinstance(spec, dict) and spec.get("key") == key else None


def load_spec(build: Callable[[], Any] | None = None) -> list[Flag] | None:
    """The flags: the shipped spec or the cached one when current, else the spec of the parser ``build`` returns
    (``flags.build_parser``: seconds, it imports torch), kept in the cache; None without ``build``."""
    key = spec_key()
    spec = _read(SHIPPED, key) or _read(_cache_file(key), key)
    if spec is None:
        if build is None:
            return None
        spec = spec_from_parser(build())
        try:
            cache = _cache_file(key)
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(spec), encoding="utf-8")
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only home: the next call rebuilds it
    return spec_flags(spec)


def spec_flags(spec: dict[str, Any]) -> list[Flag]:
    """The Flag objects of a spec."""
    return [
        Flag(
            **{
                **entry,
                "options": tuple(entry["options"]),
                "negative": tuple(entry.get("negative", ())),
                "choices": tuple(entry["choices"]) if entry["choices"] else None,
            }
        )
        for entry in spec["flags"]
    ]


def stray_word_error(word: str) -> ConfigError:
    """The one-line error for a word that no flag takes."""
    return ConfigError(f"unexpected argument {word!r}; flags look like --name value")


def unknown_flag_error(given: str, valid: Sequence[str], command: str = "train") -> ConfigError:
    """The one-line error for a flag no parser knows, naming the closest valid flags."""
    names = sorted({v.lstrip("-").replace("-", "_") for v in valid})
    matches = closest(given.lstrip("-").replace("-", "_"), names)
    hint = " Did you mean " + " or ".join(f"--{m}" for m in matches) + "?" if matches else ""
    return ConfigError(f"unknown flag {given}.{hint} (all flags: trainer-ext {command} --help)")


def _check_value(flag: Flag, option: str, value: str) -> Any:
    """``value`` as ``flag`` takes it; ConfigError if it cannot (argparse's checks, worded for a person)."""
    typed: Any = value
    if flag.kind in ("int", "float"):
        try:
            typed = (int if flag.kind == "int" else float)(value)
        except ValueError:
            number = "a whole number" if flag.kind == "int" else "a number"
            raise ConfigError(f"{option} takes {number}, got {value!r}") from None
    elif flag.kind == "bool":
        if value.lower() not in TRUE_WORDS + FALSE_WORDS:
            raise ConfigError(f"{option} takes true or false, got {value!r}")
        typed = value.lower() in TRUE_WORDS
    if flag.choices and value not in flag.choices:
        near = closest(value, flag.choices)
        hint = " Did you mean " + " or ".join(repr(m) for m in near) + "?" if near else ""
        shown = (
            ", ".join(flag.choices)
            if len(flag.choices) <= 12
            else f"see trainer-ext train --help for the {len(flag.choices)}"
        )
        raise ConfigError(f"{option} {value!r} is not one of {shown}.{hint}")
    return typed


# what argparse reads as a negative number, hence a value, when a word starts with "-"
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _is_value(word: str) -> bool:
    """A word that is a value, not a flag: as argparse tells them apart."""
    return not word.startswith("-") or word == "-" or bool(_NEGATIVE_NUMBER.match(word))


def check_argv(argv: Sequence[str], flags: Sequence[Flag], command: str = "train") -> dict[str, Any]:
    """Check every flag of ``argv`` against ``flags`` and return the values given by destination (``config``: the
    files, in order); ConfigError on the first unknown flag, stray word, missing or ill-typed value."""
    by_option: dict[str, Flag] = {}
    for flag in flags:
        for option in flag.options:
            by_option[option] = flag
        for option in flag.negative:
            by_option[option] = Flag(flag.dest, (option,), "switch", None, None, False, flag.help)
    given: dict[str, Any] = {}
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if _is_value(word):
            raise stray_word_error(word)
        option, inline = (word.split("=", 1) + [None])[:2] if "=" in word else (word, None)
        if option not in by_option:
            raise unknown_flag_error(option, list(by_option), command)
        flag = by_option[option]
        values: list[str] = [inline] if inline is not None else []
        if flag.kind == "switch":
            if inline is not None:
                raise ConfigError(f"{option} takes no value, got {inline!r}")
            given[flag.dest] = False  # --no_x
            continue
        if inline is None:
            while i < len(words) and _is_value(words[i]) and (flag.nargs in ("+", "*") or not values):
                values.append(words[i])
                i += 1
        if not values and flag.nargs not in ("?", "*"):
            raise ConfigError(f"{option} needs a value")
        typed = [_check_value(flag, option, value) for value in values]
        if flag.dest == "config":
            given.setdefault("config", []).extend(typed)
        elif flag.nargs in ("+", "*"):
            given[flag.dest] = typed
        else:
            given[flag.dest] = typed[0] if typed else True  # a bare boolean flag means true
    return given


def write_shipped(parser: Any, path: Path = SHIPPED) -> Path:
    """Write the spec of ``parser`` as the shipped file (``python -m trainer_ext.job.flags`` after a flag changes)."""
    path.write_text(json.dumps(spec_from_parser(parser), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
