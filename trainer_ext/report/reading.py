"""Reading a run folder's files safely: regular files only, a size bound, JSON nesting bound, one-line reasons.

A FIFO (which would block the reader forever), a device such as ``/dev/zero`` (endless), a folder, a file larger
than its bound or JSON nested too deep is not read: :class:`Unreadable` carries the one-line reason, which the caller
turns into a ConfigError (a file the report needs) or a note on the page (a file it can do without).
"""

from __future__ import annotations

import errno
import json
import stat
from pathlib import Path
from typing import Any

from trainer_ext.config_files import NotRegularFile, TooLarge, read_regular
from trainer_ext.errors import ConfigError

MiB = 1 << 20
# the bounds on what is read: the trainer state and the event log grow with the run; the others are a few lines
STATE_MAX_BYTES = 512 * MiB
EVENTS_MAX_BYTES = 512 * MiB
SMALL_MAX_BYTES = 16 * MiB
# a missing file, or a path through something that is not a folder
_ABSENT = (errno.ENOENT, errno.ENOTDIR)


class Unreadable(Exception):
    """A file that is there but was not read; ``str()`` is the one-line reason, naming the file."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_bytes(path: Path, limit: int) -> bytes | None:
    """The bytes of the regular file ``path`` (a link to one is followed), or None when there is no such file;
    Unreadable when it is not a regular file (a FIFO is never waited on), is larger than ``limit`` bytes, or
    cannot be opened or read (:func:`~trainer_ext.config_files.read_regular`)."""
    try:
        return read_regular(path, limit)
    except OSError as error:
        if error.errno in _ABSENT:
            return None
        raise Unreadable(f"{path} cannot be read: {error.strerror or error}") from error
    except NotRegularFile as found:
        raise Unreadable(f"{path} is {_kind(found.mode)}, not a regular file") from None
    except TooLarge as big:
        if big.size is None:
            raise Unreadable(f"{path} grew past {limit:,} bytes while being read") from None
        raise Unreadable(f"{path} has {big.size:,} bytes, more than the {limit:,} read") from None


def parse_json(text: str | bytes, path: Path) -> Any:
    """``text`` parsed as JSON; Unreadable (naming ``path``) when it is not JSON or is nested too deep."""
    try:
        return json.loads(text)
    except RecursionError as error:
        raise Unreadable(f"{path} is nested too deep to read") from error
    except ValueError as error:  # UnicodeDecodeError is a ValueError
        raise Unreadable(f"{path} is not valid JSON ({_short(error)}; the file may have been cut short)") from error


def read_json(path: Path, limit: int = SMALL_MAX_BYTES) -> Any:
    """The JSON in ``path``, or None when there is no such file; Unreadable as :func:`read_bytes` and :func:`parse_json`."""
    data = read_bytes(path, limit)
    return None if data is None else parse_json(data, path)


def optional_object(path: Path, notes: list[str] | None = None, limit: int = SMALL_MAX_BYTES) -> dict[str, Any]:
    """The JSON object in ``path``, or {} when it is missing, unreadable or not an object (said in ``notes``)."""
    try:
        value = read_json(path, limit)
    except Unreadable as why:
        if notes is not None:
            notes.append(f"{why}: not read")
        return {}
    return value if isinstance(value, dict) else {}


def one_line(text: str) -> str:
    """``text`` with its line breaks and other control characters escaped (a folder named with a newline)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _short(error: Exception, most: int = 120) -> str:
    text = str(error)
    return text if len(text) <= most else text[: most - 1] + "…"


def is_dir(path: Path, what: str) -> bool | None:
    """Whether ``path`` is a folder (True), something else (False) or missing (None); ConfigError when the path
    itself cannot be looked at (a name too long for the file system, a loop of links, no permission)."""
    try:
        info = path.stat()
    except OSError as error:
        if error.errno in _ABSENT:
            return None
        raise ConfigError(
            f"{what} {_short(repr(str(path)), 200)} cannot be used ({error.strerror or error}): pass another path"
        ) from error
    return stat.S_ISDIR(info.st_mode)
