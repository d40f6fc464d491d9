"""Verification of a checkpoint's contents: its files as committed, what its kind needs, every file safe to load.

Safetensors headers, torch files (``weights_only=True``), DCP metadata (an allow-list) and a DeepSpeed checkpoint's
files (``deepspeed_files``) are opened; nothing in a checkpoint runs code while it is checked.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from trainer_ext.checkpointing import deepspeed_files
from trainer_ext.checkpointing.durable import crc32
from trainer_ext.checkpointing.marker import (
    COMPLETE,
    LOOP,
    SAVING,
    TRAINER,
    TRAINER_STATE,
    CheckpointError,
    listed_files,
    read_marker,
)
from trainer_ext.checkpointing.safe_globals import numpy_rng_safe_globals

# a Trainer checkpoint's weights: transformers' files (whole, sharded, adapter) or a strategy's own format
WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model_sharded/.metadata",  # FSDP2 sharded state (checkpointing.sharded)
    deepspeed_files.LATEST,  # DeepSpeed's own checkpoint: its tag folder beside it
)
LOOP_STATE = "random_states_0.pkl"  # an Accelerator state: process 0's random states are always written
# pickled objects that are never loaded on resume (transformers writes the arguments object for reference)
_NOT_LOADED = {"training_args.bin"}
SEAL_COMMAND = "trainer-ext checkpoint seal"  # re-checks a folder changed by hand and commits it afresh (.audit)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint folder, worded as the refusal says it; ``changed`` when a file differs
    from what the marker recorded (missing, resized, other bytes, added): sealing fixes it if that was on purpose."""

    text: str
    changed: bool = False


def seal_hint(directory: str | os.PathLike, done: str = "changed these files") -> str:
    """What a refusal adds when the files differ from their marker: how to commit a deliberate change."""
    return f"; if you {done} on purpose, run `{SEAL_COMMAND} {shlex.quote(os.fspath(directory))}`"


# safetensors' words for what is wrong with a file it cannot open, and how we say it
_SAFETENSORS_ERRORS = (
    ("header too small", "is truncated ({size} bytes)"),
    ("invalid header length", "is truncated or corrupted (its header does not fit in its {size} bytes)"),
    ("not fully covered", "is truncated or corrupted ({size} bytes, not what its header describes)"),
    ("too large", "has a corrupted header ({reason})"),
)


def check_safetensors(path: Path) -> dict[str, Any]:
    """The header of a safetensors file, as ``{name: {"dtype", "shape"}, "__metadata__": {...}}``.

    ``safetensors.safe_open`` reads the header only and checks that the tensors' offsets, shapes and dtypes agree
    and cover the file exactly; CheckpointError when it refuses (truncated, corrupted, or not safetensors).
    """
    size = path.stat().st_size
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
            header: dict[str, Any] = {}
            for name in handle.keys():
                view = handle.get_slice(name)
                header[name] = {"dtype": view.get_dtype(), "shape": list(view.get_shape())}
    except SafetensorError as error:
        reason = " ".join(str(error).split())[:300]
        said = next((text for words, text in _SAFETENSORS_ERRORS if words in reason), None)
        if said is None:  # invalid JSON, a value that is no tensor entry, offsets that do not add up
            said = "has a malformed header (not safetensors' layout: {reason})"
        raise CheckpointError(f"{path.name} " + said.format(size=size, reason=reason)) from error
    if metadata is not None:
        header["__metadata__"] = metadata
    return header


def check_torch_file(path: Path) -> None:
    """Open a torch file with ``weights_only=True`` (no code runs); CheckpointError when it fails."""
    try:
        with numpy_rng_safe_globals():
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # truncated zip, bad pickle, or a global outside the weights-only allow-list
        reason = " ".join(str(error).split())[:300]
        raise CheckpointError(f"{path.name} cannot be loaded safely (weights_only=True): {reason}") from error


def check_zip(path: Path) -> None:
    """A torch file checked as the zip archive it is (every member's CRC), without unpickling it."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as error:
        raise CheckpointError(f"{path.name} is truncated or corrupted ({error})") from error
    if bad is not None:
        raise CheckpointError(f"{path.name} is corrupted (member {bad} fails its checksum)")


def check_dcp_metadata(path: Path) -> None:
    """A DCP folder's ``.metadata`` read through the allow-list, its non-tensor values ``weights_only``."""
    from trainer_ext.checkpointing.safe_dcp import UnsafeCheckpointError, check_values, load_metadata

    try:
        check_values(path.parent, load_metadata(path))
    except (UnsafeCheckpointError, OSError) as error:
        raise CheckpointError(str(error)) from error
    except Exception as error:  # metadata of DCP's classes, holding values of unexpected types
        raise CheckpointError(
            f"{path.parent.name}/{path.name} is malformed ({type(error).__name__}: {error}); it is corrupted or crafted"
        ) from error


def check_trainer_state(path: Path) -> None:
    """``trainer_state.json`` must be what the Trainer reloads: an object, its ``global_step`` (0 when absent) a
    non-negative integer."""
    state = json.loads(path.read_text(encoding="utf-8"))
    step = state.get("global_step", 0) if isinstance(state, dict) else None
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{path.name} is not a Trainer state (an object with a non-negative global_step)")


def check_weight_index(src: Path, path: Path) -> None:
    """A sharded weights index (``*.index.json``): every tensor it maps is in a shard inside ``src`` that holds it.

    A safetensors shard's header is read for its tensor names; a pickled shard is only required to exist.
    """
    index = json.loads(path.read_text(encoding="utf-8"))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path.name} is not a weights index (no weight_map of tensor names to shard files)")
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(tensor, str) or not isinstance(shard, str):
            raise CheckpointError(f"{path.name} maps {tensor!r} to {shard!r}: not a tensor name and a shard file")
        shards.setdefault(shard, []).append(tensor)
    for shard, tensors in sorted(shards.items()):
        file = _inside(src, shard, listed_by=path.name)
        if file.is_symlink() or not file.is_file():
            raise CheckpointError(f"{path.name} names {shard}, which is not a file of the checkpoint")
        if file.suffix != ".safetensors":
            continue
        absent = sorted(set(tensors) - set(check_safetensors(file)))
        if absent:
            more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
            raise CheckpointError(f"{path.name} places {absent[0]}{more} in {shard}, which does not hold it")


def _inside(src: Path, name: Any, listed_by: str = COMPLETE) -> Path:
    """``src / name`` for a marker's file name; CheckpointError unless it is a relative path inside ``src``."""
    path = src / name if isinstance(name, str) and name else None
    if (
        path is None
        or Path(name).is_absolute()
        or ".." in Path(name).parts
        or not path.resolve().is_relative_to(src.resolve())
    ):
        raise CheckpointError(
            f"{listed_by} lists {name!r}, which is not a file inside the checkpoint: corrupted or crafted"
        )
    return path


def check_contents(directory: str | os.PathLike, kind: str | None) -> None:
    """CheckpointError unless ``directory`` holds what a checkpoint of ``kind`` needs to be resumed from.

    ``trainer``: ``trainer_state.json`` and the model's weights in one of :data:`WEIGHTS`; ``loop``: process 0's
    random states (written by every ``save_state``). A marker alone, or a folder missing its weights, is not a
    checkpoint, whatever its marker says.
    """
    src = Path(directory)
    if kind == TRAINER:
        missing = [] if (src / TRAINER_STATE).is_file() else [TRAINER_STATE]
        if not any((src / name).is_file() for name in WEIGHTS):
            missing.append("the model's weights (none of " + ", ".join(WEIGHTS) + ")")
    elif kind == LOOP:
        missing = [] if (src / LOOP_STATE).is_file() else [LOOP_STATE]
    else:
        return
    if missing:
        raise CheckpointError(f"is missing {' and '.join(missing)}: not a whole {kind} checkpoint")


def _check_file(src: Path, path: Path) -> None:
    """CheckpointError when ``path`` cannot be loaded safely, by what its loader would do with it."""
    if path.suffix == ".safetensors":
        check_safetensors(path)
    elif path.name == ".metadata":
        check_dcp_metadata(path)  # DCP unpickles it in full: only its own classes may be in it
    elif deepspeed_files.owns(src, path):
        deepspeed_files.check(path, check_zip)
    elif path.suffix in (".pt", ".pth", ".bin") and path.name not in _NOT_LOADED:
        check_torch_file(path)
    elif path.suffix == ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except ValueError as error:
            raise CheckpointError(f"{path.name} is not valid JSON ({error})") from error
        if path.name == TRAINER_STATE and path.parent == src:
            check_trainer_state(path)
        elif path.name.endswith(".index.json") and path.parent == src:
            check_weight_index(src, path)


def _problem(check: Callable[..., Any], *args: Any) -> Problem | None:
    """``check(*args)``'s refusal as a Problem (a file that cannot be read is one too), None when it passes."""
    try:
        check(*args)
    except CheckpointError as error:
        return Problem(str(error))
    except OSError as error:
        return Problem(f"{Path(error.filename or '?').name} cannot be read ({error.strerror or error})")
    return None


def find_problems(
    directory: str | os.PathLike,
    marker: dict[str, Any],
    *,
    part: tuple[int, int] = (0, 1),
    kind: str | None = None,
    extra: bool = False,
) -> Iterator[Problem]:
    """Everything wrong with a checkpoint folder, in the order :func:`verify` refuses: the contents ``kind`` needs,
    links, each file ``marker`` lists (``{}``: none), with ``extra`` the files it does not list, then each file's
    loadability. A link is reported, never read through."""
    src = Path(directory)
    if (problem := _problem(check_contents, src, kind)) is not None:
        yield problem
    for path in sorted(p for p in src.rglob("*") if p.is_symlink()):  # rglob does not enter linked folders
        yield Problem(
            f"{path.relative_to(src)} is a symbolic link: a checkpoint holds plain files and folders only (a "
            "link lets the loader read files nobody checked); replace it with what it points to"
        )
    files, crcs = marker.get("files") or {}, marker.get("crc32") or {}
    differ = set()
    for name, size in files.items():
        try:
            path = _inside(src, name)
        except CheckpointError as error:
            differ.add(name)
            yield Problem(str(error))
            continue
        if path.is_symlink() or not path.is_file():
            differ.add(name)
            if not path.is_symlink():  # a link is reported above
                yield Problem(f"{name} is missing (listed in {COMPLETE})", changed=True)
        elif path.stat().st_size != size:
            differ.add(name)
            yield Problem(f"{name} has {path.stat().st_size} bytes, {size} when committed (truncated?)", changed=True)
    index, count = part
    for name, expected in sorted(crcs.items())[index::count]:
        if name in differ:
            continue
        try:
            same = crc32(src / name) == expected
        except OSError as error:
            yield Problem(f"{name} cannot be read ({error.strerror or error})")
            continue
        if not same:
            yield Problem(f"{name} does not match its checksum in {COMPLETE} (corrupted after it was written)", True)
    if extra:
        for name in sorted(set(listed_files(src)) - set(files)):
            if not any(p.is_symlink() for p in (src / name, *(src / name).parents)):  # links: reported above
                yield Problem(f"{name} is not listed in {COMPLETE} (added after it was written)", changed=True)
    for path in sorted(src.rglob("*")):
        if not path.is_symlink() and path.is_file() and (problem := _problem(_check_file, src, path)) is not None:
            yield problem


def verify(
    directory: str | os.PathLike,
    *,
    require_marker: bool = True,
    part: tuple[int, int] = (0, 1),
    kind: str | None = None,
) -> dict[str, Any]:
    """Check a checkpoint: marker present and whole, file sizes and checksums as committed, the contents its kind
    needs (``kind``, else the marker's), every file it loads readable safely; every file listed in the marker (one
    it leaves out was added, or dropped from a marker resealed by hand: refused, never loaded unchecked).

    ``part=(i, n)``: checksum only every n-th committed file from the i-th, so n processes share the reading.
    A refusal caused by files that differ from their marker says how to commit them (:data:`SEAL_COMMAND`).
    """
    src = Path(directory)
    if src.is_symlink():
        raise CheckpointError(
            f"{src.name} is itself a symbolic link: a checkpoint is a plain folder (a link lets the loader read "
            "files from anywhere, and rotation would delete what it points to); copy the folder instead"
        )
    marker = read_marker(src)
    if marker is None:
        if require_marker:
            unfinished = (src / SAVING).exists()  # a save that died: nothing to seal
            raise CheckpointError(
                f"no {COMPLETE} marker (missing, or interrupted while saving)"
                + ("" if unfinished else seal_hint(src, "removed it"))
            )
        marker = {}
    # a marker lists every file of its folder when written: one it leaves out is not trusted (nor loaded unchecked)
    for problem in find_problems(src, marker, part=part, kind=kind or marker.get("kind"), extra=bool(marker)):
        raise CheckpointError(problem.text + (seal_hint(src) if problem.changed else ""))
    return marker
