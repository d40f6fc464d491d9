"""The one reader of YAML/JSON config files: a mapping of keys to values, or one ConfigError that says what is wrong.

Every config file of trainer_ext goes through here (``train --config``, launch configs, FSDP and DeepSpeed
configs), so each says the same thing about the same mistake. ``.json`` files are JSON, every other file YAML;
a caller may insist on one format (DeepSpeed configs are JSON whatever their name). Errors name ``what`` the
file is for and the path: "--config run.yaml is not valid YAML: ...". Its bounded reader of regular files
(:func:`read_regular`: never a FIFO or a device) serves every file a user names, the run report's too.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Sequence
from typing import Any

import yaml

from trainer_ext.errors import ConfigError

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
    name = f"{what} {os.fspath(path)}"
    if suffixes is not None and not os.fspath(path).lower().endswith(tuple(suffixes)):
        raise ConfigError(f"{name}: unsupported file type; use {', '.join(suffixes)}")
    chosen = fmt or file_format(path)
    text = read_text(path, name, limit=MAX_JSON_BYTES if chosen == JSON else MAX_YAML_BYTES, hint=hint)
    return parse_mapping(text, name, fmt=chosen, unique_keys=unique_keys)


MAX_YAML_BYTES = 1 << 20  # configs are a few KB; PyYAML reads about 150 KB a second
MAX_JSON_BYTES = 16 << 20  # a model's config.json with a large label map runs to a few MB
_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class NotRegularFile(Exception):
    """What :func:`read_regular` found instead of a regular file; ``mode`` is its ``st_mode``."""

    def __init__(self, mode: int) -> None:
        super().__init__(f"not a regular file (mode {mode:o})")
        self.mode = mode


class TooLarge(Exception):
    """A file past :func:`read_regular`'s limit; ``size`` is its size, None when it grew past it while read."""

    def __init__(self, size: int | None) -> None:
        super().__init__(f"larger than the limit ({size} bytes)")
        self.size = size


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (a link to one is followed), at most ``limit``: opened non-blocking,
    so a FIFO is refused at once (NotRegularFile) instead of waiting for a writer, and a device such as /dev/zero
    is never read (NotRegularFile); TooLarge past ``limit``; OSError (FileNotFoundError …) as the OS raises it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(info.st_mode)
        if info.st_size > limit:
            raise TooLarge(info.st_size)
        chunks, left = [], limit + 1  # a file that grows while read (or a /proc file of size 0) stays bounded
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise TooLarge(None)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, name: str, *, limit: int = MAX_YAML_BYTES, hint: str = "") -> str:
    """The UTF-8 text of the regular file ``path`` (``~`` expanded), at most ``limit`` bytes; one ConfigError
    naming ``name`` for anything else: missing, a folder, a FIFO or device (never opened to block or read
    without end), too large, a path the file system refuses (too long, a loop of links), not UTF-8."""
    try:
        data = read_regular(os.path.expanduser(os.fspath(path)), limit)
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"{name} does not exist (no such file){hint}") from None
    except NotRegularFile as found:
        if stat.S_ISDIR(found.mode):
            raise ConfigError(f"{name} is a directory, not a config file") from None
        kind = _KINDS.get(stat.S_IFMT(found.mode), "not a regular file")
        raise ConfigError(f"{name} is {kind}, not a regular file; give the path of a YAML or JSON file") from None
    except TooLarge:
        raise ConfigError(f"{name} is larger than {limit >> 10} KiB; a config file is a few KB of keys") from None
    except OSError as error:
        raise ConfigError(_os_problem(name, error)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{name} cannot be read: {error}") from None


def _os_problem(name: str, error: OSError) -> str:
    """An OSError about a config file as one line (ENAMETOOLONG says to shorten the path)."""
    why = error.strerror or str(error)
    if error.errno == errno.ENAMETOOLONG:
        return f"{name}: the path is too long for the file system ({why}); use a shorter path"
    return f"{name} cannot be read: {why}"


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
            data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader that also checks keys and aliases
        except _Refused as error:
            raise ConfigError(f"{what} {error}") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"{what} is not valid YAML: {_yaml_problem(error, text)}") from None
    return data


MAX_NODES = 100_000  # values in a YAML document once its aliases are expanded; configs hold a few hundred


class _Refused(ValueError):
    """A YAML document refused before it is built: a key given twice, aliases that expand without bound."""


class _Loader(yaml.SafeLoader):
    """yaml's safe loader, and each document checked once composed, before any value is built: every mapping's
    keys unique, and at most MAX_NODES values with every alias expanded (a "billion laughs" is a few hundred
    bytes of aliases of aliases), no alias inside the node it names."""

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _check_document(node, self)
        return node


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_document(root: yaml.Node, loader: _Loader) -> None:
    """_Refused unless every mapping's keys are unique and the document, aliases expanded, holds at most
    MAX_NODES nodes; each distinct node is visited once (sizes of shared nodes are remembered), without recursion."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # the nodes on the path from the root: an alias to one of them is a loop
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            open_nodes.discard(id(node))
            sizes[id(node)] = min(MAX_NODES + 1, 1 + sum(sizes[id(child)] for child in _children(node)))
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            line = node.start_mark.line + 1
            raise _Refused(f"is not valid: the YAML anchor at line {line} is used inside itself; write the values out")
        if isinstance(node, yaml.MappingNode):
            _check_keys(node, loader)
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    if sizes[id(root)] > MAX_NODES:
        raise _Refused(
            f"holds more than {MAX_NODES:,} values once its YAML aliases (*name) are expanded; "
            "write out what is repeated, or refer to fewer aliases"
        )


def _check_keys(node: yaml.MappingNode, loader: _Loader) -> None:
    """_Refused for a scalar key given twice in ``node`` (merge keys ``<<`` aside: a key may override them)."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:  # unhashable: yaml's own constructor says so
            continue
        if first is not None:
            raise _Refused(
                f"is not valid YAML: line {line}: duplicate key {key!r} (first at line {first}); keep one of them"
            )
        seen[key] = line


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
