"""The commit marker of a checkpoint: its schema, writing it last, reading and validating it, the save-in-progress tag.

A checkpoint directory counts only once ``COMPLETE`` is in it: written last, after every rank has written
its files, fsynced with its directory. The marker lists each file's size (a truncated file is caught without
reading it) and CRC-32 (any damaged byte is caught); :mod:`.verification` checks the files against it,
:mod:`.listing` lists and rotates checkpoints by it.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from trainer_ext.checkpointing.durable import checksums, fsync_dir
from trainer_ext.checkpointing.errors import CheckpointError as CheckpointError

COMPLETE = "COMPLETE"
MARKER_FORMAT = "trainer_ext_checkpoint"
MARKER_CRC = "marker_crc32"
_MARKER_MAX = 64 << 20  # bytes: a marker lists names, sizes and checksums, never data
# what a checkpoint of each kind must hold to be complete (see ``verification.check_contents``)
TRAINER, LOOP = "trainer", "loop"
KINDS = (TRAINER, LOOP)
TRAINER_STATE = "trainer_state.json"
SAVING = ".trainer_ext_saving"  # in a checkpoint folder while its save runs: a folder with it and no marker died


def listed_files(directory: str | os.PathLike) -> dict[str, int]:
    """The files a marker of ``directory`` lists, with their sizes: all of them but the marker and the save tag."""
    directory = Path(directory)
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in (COMPLETE, f".{COMPLETE}.tmp", SAVING)
    }


def write_marker(
    directory: str | os.PathLike,
    *,
    world_size: int,
    step: int | None = None,
    crcs: dict[str, int] | None = None,
    kind: str | None = None,
    **facts: Any,
) -> Path:
    """Commit ``directory``: write ``COMPLETE`` through a temporary file, fsynced.

    It records each file's size and CRC-32 (``crcs`` as computed by the ranks that wrote them; the rest read
    here), the world size, the checkpoint's ``kind`` (what it must contain: :data:`KINDS`), ``facts``, and a
    CRC-32 of all that, so that a damaged marker is told from a valid one.
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}: one of {', '.join(KINDS)}")
    out = Path(directory)
    files = listed_files(out)
    known = {name: value for name, value in (crcs or {}).items() if name in files}
    known.update(checksums(out, (name for name in files if name not in known)))
    body = {
        MARKER_FORMAT: 1,
        "world_size": world_size,
        "step": step,
        **({"kind": kind} if kind else {}),
        **facts,
        "files": files,
        "crc32": {name: known[name] for name in files},
    }
    tmp = out / f".{COMPLETE}.tmp"
    tmp.unlink(missing_ok=True)  # a leftover (or a planted link): created afresh, never written through
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with open(fd, "w", encoding="utf-8") as handle:
        json.dump(seal(body), handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, out / COMPLETE)  # a rename: a link named COMPLETE is replaced, not followed
    fsync_dir(out)
    return out / COMPLETE


def _body_crc(body: dict[str, Any]) -> int:
    """CRC-32 of a marker's contents without its own checksum, in one canonical spelling."""
    rest = {key: value for key, value in body.items() if key != MARKER_CRC}
    return zlib.crc32(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def seal(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with its own checksum (``marker_crc32``) set: what :func:`read_marker` accepts."""
    return {**{key: value for key, value in body.items() if key != MARKER_CRC}, MARKER_CRC: _body_crc(body)}


def begin_save(directory: str | os.PathLike) -> None:
    """Tag ``directory`` as a save in progress (created if needed) before anything is written into it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / SAVING).touch()
    fsync_dir(out)


def end_save(directory: str | os.PathLike) -> None:
    """Drop the in-progress tag once the marker is written."""
    (Path(directory) / SAVING).unlink(missing_ok=True)


def remove_marker(directory: str | os.PathLike) -> None:
    """Un-commit ``directory`` before it is rewritten or deleted, so it is never half-valid."""
    out = Path(directory)
    if (out / COMPLETE).exists():
        (out / COMPLETE).unlink()
        fsync_dir(out)


def read_marker(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The marker's contents, validated (:func:`check_marker`), or None when there is none.

    CheckpointError when it is there but damaged: a checkpoint whose marker fails is not complete.
    """
    path = Path(directory) / COMPLETE
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_file():
        raise CheckpointError(f"{COMPLETE} is not a plain file: corrupted or crafted")
    if path.stat().st_size > _MARKER_MAX:
        raise CheckpointError(f"{COMPLETE} has {path.stat().st_size} bytes, more than a marker holds: corrupted")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{COMPLETE} is damaged (not valid JSON: {error})") from error
    return check_marker(data)


def has_marker(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` has a ``COMPLETE`` file at all (valid or not): it was saved by trainer_ext."""
    path = Path(directory) / COMPLETE
    return path.exists() or path.is_symlink()


def is_complete(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` has a valid marker (its files are not checked: see :func:`verify`)."""
    try:
        return read_marker(directory) is not None
    except CheckpointError:
        return False


def _is_count(value: Any, low: int = 0, high: int | None = None) -> bool:
    return type(value) is int and value >= low and (high is None or value < high)


def check_marker(data: Any) -> dict[str, Any]:
    """``data`` when it is a whole marker: its format, world size, file table and checksums, and its own CRC-32.

    CheckpointError naming the first thing wrong otherwise (a truncated, emptied, retyped or edited marker).
    """
    if not isinstance(data, dict):
        raise CheckpointError(f"{COMPLETE} is damaged (it holds {json.dumps(data)[:40]}, not a marker)")
    problems = []
    if data.get(MARKER_FORMAT) != 1:
        problems.append(f"no {MARKER_FORMAT}: 1")
    if not _is_count(data.get("world_size"), 1):
        problems.append("world_size is not a positive integer")
    if data.get("step") is not None and not _is_count(data["step"]):
        problems.append("step is not a non-negative integer")
    if data.get("kind") is not None and data["kind"] not in KINDS:
        problems.append(f"kind {data['kind']!r} is unknown")
    files, crcs = data.get("files"), data.get("crc32")
    if not isinstance(files, dict) or not files:
        problems.append("files is not a table of the checkpoint's files")
    elif not all(isinstance(name, str) and _is_count(size) for name, size in files.items()):
        problems.append("files has an entry that is not a name and a size in bytes")
    if not isinstance(crcs, dict) or not all(_is_count(value, 0, 1 << 32) for value in crcs.values()):
        problems.append("crc32 is not a table of checksums")
    elif isinstance(files, dict) and set(crcs) != set(files):
        problems.append("crc32 does not cover exactly the listed files")
    if not _is_count(data.get(MARKER_CRC), 0, 1 << 32):
        problems.append(f"no {MARKER_CRC}")
    elif not problems and data[MARKER_CRC] != _body_crc(data):
        problems.append(f"its contents do not match its own checksum ({MARKER_CRC})")
    if problems:
        raise CheckpointError(f"{COMPLETE} is damaged or not trainer_ext's: " + "; ".join(problems))
    return data
