"""The one reader of YAML/JSON config files: a mapping of keys to values, or one ConfigError that says what is wrong.

Every config file of trainer_ext goes through here (``train --config``, launch configs, FSDP and DeepSpeed
configs), so each says the same thing about the same mistake. ``.json`` files are JSON, every other file YAML;
a caller may insist on one format (DeepSpeed configs are JSON whatever their name). Errors name ``what`` the
file is for and the path: "--config run.yaml is not valid YAML: ...".
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

JSON, YAML = "JSON", "YAML"


def file_format(path: str | os.PathLike) -> str:
    """JSON for a ``.json`` file (any case), YAML for every other (YAML also reads most JSON)."""
    return JSON if os.fspath(path).lower().endswith(".json") else YAML


def load_mapping(
    path: str | os.PathLike,
    what: str,
    *,
    fmt: str | None = None,
    suffixes: Sequence[str] | None = None,
    unique_keys: bool = False,
    hint: str = "",
) -> dict[str, Any]:
    """The mapping in the YAML or JSON file ``path`` (``~`` expanded); an empty file is ``{}``.

    ``what`` names the file in messages (e.g. ``"--config"``, ``"DeepSpeed config"``); ``fmt`` forces JSON or
    YAML; ``suffixes`` refuses other file types; ``unique_keys`` refuses a JSON key given twice (which JSON
    parsers otherwise resolve silently, last one wins); ``hint`` is added to the message for a missing file.
    """
    file = Path(path).expanduser()
    name = f"{what} {os.fspath(path)}"
    if suffixes is not None and not file.name.lower().endswith(tuple(suffixes)):
        raise ConfigError(f"{name}: unsupported file type; use {', '.join(suffixes)}")
    if not file.exists():
        raise ConfigError(f"{name} does not exist (no such file){hint}")
    if file.is_dir():
        raise ConfigError(f"{name} is a directory, not a config file")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ConfigError(f"{name} cannot be read: {why}") from None
    return parse_mapping(text, name, fmt=fmt or file_format(file), unique_keys=unique_keys)


MAX_DEPTH = 64  # levels of nesting: real configs use a handful; thousands would exhaust the stack downstream


def parse_mapping(text: str, what: str, *, fmt: str = YAML, unique_keys: bool = False) -> dict[str, Any]:
    """The mapping in YAML or JSON ``text`` (inline JSON from a flag, or a file's contents) named ``what``."""
    too_deep = ConfigError(f"{what} is nested more than {MAX_DEPTH} levels deep; a config is a few levels of keys")
    try:
        data = _parse(text, what, fmt, unique_keys)
    except RecursionError:
        raise too_deep from None
    if data is None and fmt == YAML:
        return {}
    if _depth(data) > MAX_DEPTH:
        raise too_deep
    if not isinstance(data, dict):
        expected = "a JSON object ({...})" if fmt == JSON else "a mapping of keys to values"
        raise ConfigError(f"{what} must hold {expected}, not {type(data).__name__}")
    return data


def _depth(data: Any) -> int:
    """Levels of nesting of lists and mappings, counted without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def _parse(text: str, what: str, fmt: str, unique_keys: bool) -> Any:
    if fmt == JSON:
        hook = _refuse_duplicate_keys if unique_keys else None
        try:
            data = json.loads(text, object_pairs_hook=hook)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{what} is not valid JSON: line {error.lineno}, column {error.colno}: {error.msg}"
            ) from None
        except _DuplicateKey as error:
            raise ConfigError(f"{what} is not valid: duplicate key {error.key!r}; keep one of them") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"{what} is not valid YAML: {_yaml_problem(error, text)}") from None
    return data


SNIPPET_WIDTH = 100  # characters of the offending line shown around the caret


def _yaml_problem(error: yaml.YAMLError, text: str) -> str:
    """yaml's complaint as one line (where, what, in which construct), then the offending line with a caret
    under the column, indented; without a position, yaml's own words on one line."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if problem is None or mark is None:
        return " ".join(str(error).split())
    message = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context:
        started = f" at line {context_mark.line + 1}, column {context_mark.column + 1}" if context_mark else ""
        message += f" ({context}{started})"
    snippet = _snippet(text, mark) or (_snippet(text, context_mark) if context_mark else "")
    return message + snippet


def _snippet(text: str, mark: yaml.Mark) -> str:
    """The line at ``mark`` and a caret under its column (tabs shown as spaces so the caret lines up), or ''."""
    lines = text.splitlines()
    if mark.line >= len(lines) or not lines[mark.line].strip():
        return ""
    line = lines[mark.line].replace("\t", " ")
    start = max(0, min(mark.column - SNIPPET_WIDTH // 2, len(line) - SNIPPET_WIDTH))
    shown = line[start : start + SNIPPET_WIDTH]
    return f"\n    {shown}\n    {' ' * (mark.column - start)}^"


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen
