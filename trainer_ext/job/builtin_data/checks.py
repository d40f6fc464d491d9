"""Checks on a job's data: each data file is a regular file, every row has text, every label is a class.

Each failure is one ConfigError line naming the file and the row (or JSON line) to fix. The file checks only
``stat`` the path, never open it, so a FIFO cannot hang the job and ``/dev/zero`` cannot fill its memory.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from trainer_ext.errors import ConfigError

if TYPE_CHECKING:
    import datasets

# the most classes a job may have (as the model-config limits allow): label ids are names of classes, not counts
MAX_CLASSES = 2**20
# label ids up to this many past the distinct labels present are taken as classes missing from the data
SPARE_IDS = 16
# a JSON data file is scanned for its bad line only up to this size (past it, the loader's own words are kept)
MAX_SCAN_BYTES = 1 << 30


def check_data_file(path: str, flag: str) -> None:
    """``path`` is a regular file (or a link to one); ConfigError saying what it is otherwise. Never opens it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        dangling = os.path.islink(path)
        raise ConfigError(
            f"--{flag} {path!r}: "
            + ("a link to nothing (its target is gone)" if dangling else "no such file")
            + ". Check the path."
        ) from None
    except (OSError, ValueError) as error:  # a name too long, a loop of links, no permission, a NUL byte
        raise ConfigError(f"--{flag} {path!r}: cannot be read ({_words(error)}). Check the path.") from None
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        what = "a folder; give one data file in it (.jsonl, .json, .csv, .parquet, …)"
    elif stat.S_ISFIFO(mode):
        what = "a FIFO (named pipe), not a regular file; write the data to a file and give that"
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        what = "a device, not a regular file; give a data file"
    else:
        what = "a socket, not a regular file; give a data file"
    raise ConfigError(f"--{flag} {path!r} is {what}")


def _words(error: BaseException) -> str:
    """An OSError's reason, or any error's message, on one line."""
    said = getattr(error, "strerror", None) or str(error)
    return " ".join(said.split())[:300] or type(error).__name__


def bad_json_line(path: str) -> str | None:
    """Where a JSON data file first fails to parse, as 'line N: reason'; None when it parses (or is too big)."""
    try:
        if os.path.getsize(path) > MAX_SCAN_BYTES:
            return None
        with open(path, encoding="utf-8", errors="strict") as f:
            text = f.read()
    except UnicodeDecodeError as error:
        line = error.object[: error.start].count(b"\n") + 1
        return f"line {line}: not UTF-8 text (byte {error.object[error.start]:#04x})"
    except OSError:
        return None
    first = text.lstrip()[:1]
    try:
        document = json.loads(text) if first in ("[", "{") else None
    except json.JSONDecodeError as error:
        document = error
    except RecursionError:
        return "line 1: nested too deep"
    if document is not None and not isinstance(document, json.JSONDecodeError):
        return None  # one JSON document that parses: the loader's complaint is about its shape
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if isinstance(document, json.JSONDecodeError) and number == 1:  # a document spanning lines
                return f"line {document.lineno} column {document.colno}: {document.msg}"
            return f"line {number}: {error.msg} (column {error.colno})"
        except RecursionError:
            return f"line {number}: nested too deep"
        if not isinstance(row, dict):
            return f"line {number}: a JSON Lines row must be an object {{...}}, got {type(row).__name__}"
    return None


def check_rows(
    raw: Mapping[str, datasets.Dataset],
    sources: Mapping[str, str],
    text_column: str,
    label_column: str | None,
    num_labels: int | None = None,
) -> None:
    """Every row's text is a string and every label a class name or a sensible class id; ConfigError naming the
    source and the row. ``sources`` says, per split, where its rows come from (e.g. ``"'train.jsonl'"``); rows count
    from 1."""
    ids: list[tuple[int, str, int]] = []  # (class id, source, row) of integer labels
    for split, dataset in raw.items():
        where = sources.get(split, f"the {split} data")
        row, value = _first_not_text(dataset, text_column)
        if row is not None:
            found = "no value" if value is None else f"{type(value).__name__} {_short(value)}"
            raise ConfigError(
                f"row {row} of {where} has {found} in the text column {text_column!r}; every row needs a string "
                "there (fix or drop that row)"
            )
        if label_column is None or type(dataset.features[label_column]).__name__ == "ClassLabel":
            continue  # a ClassLabel's ids index its own names
        for row, value in enumerate(dataset[label_column], start=1):
            if value is None:
                raise ConfigError(
                    f"row {row} of {where} has no value in the label column {label_column!r}; fix or drop it"
                )
            if not isinstance(value, str) and not _is_class_id(value):
                raise ConfigError(
                    f"row {row} of {where}: the label {_short(value)} is not a class; the label column "
                    f"{label_column!r} must hold class names or class ids 0, 1, 2, … (regression is not supported)"
                )
            if not isinstance(value, str):
                ids.append((int(value), where, row))
    if ids:
        limit = id_limit(len({i for i, _, _ in ids}), num_labels)
        bad = next(((i, where, row) for i, where, row in ids if i >= limit), None)
        if bad is not None:
            raise ConfigError(f"row {bad[2]} of {bad[1]}: {_beyond(bad[0], (i for i, _, _ in ids))}")


def id_limit(distinct: int, num_labels: int | None) -> int:
    """The first class id taken as absurd for data holding ``distinct`` integer labels: one past the classes
    ``--num_labels`` declares, or a few past the labels present, and never past MAX_CLASSES."""
    return min(MAX_CLASSES, max(num_labels or 0, distinct + SPARE_IDS))


def _beyond(label: int, ids: Iterable[int]) -> str:
    """Why ``label`` is refused, and the fix."""
    distinct = sorted(set(ids))
    if label >= MAX_CLASSES:
        return (
            f"the label {label} is past the {MAX_CLASSES:,} classes a job may have; labels are class ids 0, 1, 2, "
            "… or class names"
        )
    shown = ", ".join(str(i) for i in distinct[:5]) + (", …" if len(distinct) > 5 else "")
    return (
        f"the label {label} is far beyond the {len(distinct)} distinct labels the data holds ({shown}); class ids "
        f"count from 0 (0, 1, 2, …). If there really are {label + 1} classes, pass --num_labels {label + 1}"
    )


def _first_not_text(dataset: datasets.Dataset, column: str) -> tuple[int | None, Any]:
    """The first row (from 1) whose ``column`` is not a string, and its value; (None, None) when all are."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = dataset.data.column(column)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        if not values.null_count:
            return None, None
        return int(pc.index(pc.is_null(values), True).as_py()) + 1, None
    for row, value in enumerate(dataset[column], start=1):  # mixed or other types: a rare, failing case
        if not isinstance(value, str):
            return row, value
    return None, None


def _is_class_id(value: Any) -> bool:
    """An integer 0 or more (1.0 counts: a CSV may read ids as floats)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return isinstance(value, float) and value.is_integer() and value >= 0


def _short(value: Any) -> str:
    """A value as the user wrote it, cut short."""
    said = repr(value)
    return said if len(said) <= 60 else said[:57] + "..."


def class_count(ids: Iterable[int], num_labels: int | None, column: str) -> int:
    """How many classes integer labels ``ids`` stand for (largest + 1, at least ``num_labels``); ConfigError for an id
    far past the distinct ones present (the rows were named by ``check_rows`` when the data came from a file)."""
    distinct = set(ids)
    largest = max(distinct, default=0)
    if largest >= id_limit(len(distinct), num_labels):
        raise ConfigError(f"the label column {column!r}: {_beyond(largest, distinct)}")
    return max(largest + 1, num_labels or 0)
