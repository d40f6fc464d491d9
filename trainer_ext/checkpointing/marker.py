"""The commit marker of a checkpoint, its verification, the newest complete checkpoint and safe rotation.

A checkpoint directory counts only once ``COMPLETE`` is in it: written last, after every rank has written
its files, fsynced with its directory. The marker lists each file's size (a truncated file is caught without
reading it) and CRC-32 (any damaged byte is caught); safetensors headers, torch files (``weights_only=True``),
DCP metadata (an allow-list) and DeepSpeed's files (``weights_only`` with its few classes) are also opened.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

COMPLETE = "COMPLETE"
MARKER_FORMAT = "trainer_ext_checkpoint"
MARKER_CRC = "marker_crc32"
_MARKER_MAX = 64 << 20  # bytes: a marker lists names, sizes and checksums, never data
# what a checkpoint of each kind must hold to be complete (see ``check_contents``)
TRAINER, LOOP = "trainer", "loop"
KINDS = (TRAINER, LOOP)
TRAINER_STATE = "trainer_state.json"
# a Trainer checkpoint's weights: transformers' files (whole, sharded, adapter) or a strategy's own format
WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model_sharded/.metadata",  # FSDP2 sharded state (checkpointing.sharded)
    "latest",  # DeepSpeed's own checkpoint: its tag folder beside it
)
LOOP_STATE = "random_states_0.pkl"
SAVING = ".trainer_ext_saving"  # in a checkpoint folder while its save runs: a folder with it and no marker died  # an Accelerator state: process 0's random states are always written
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# pickled objects that are never loaded on resume (transformers writes the arguments object for reference)
_NOT_LOADED = {"training_args.bin"}
_LATEST_MAX = 256  # bytes: DeepSpeed's ``latest`` holds a tag name such as ``global_step1200``


class CheckpointError(Exception):
    """A checkpoint directory that must not be resumed from; the message says why."""


# fsync refused because the file system cannot do it (some refuse it on folders, or read-only mounts): nothing
# to make durable there. Any other error (EIO, ENOSPC ...) means data may be lost: it is raised.
_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.EROFS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF}


def _fsync(fd: int, path: Path) -> None:
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno in _FSYNC_UNSUPPORTED:
            return
        raise OSError(
            error.errno,
            f"cannot make {path} durable (fsync failed: {error.strerror}); the checkpoint is not committed: "
            "check the disk (space, errors) and save again",
        ) from error


def fsync_dir(path: Path) -> None:
    """Make a rename, creation or removal inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        _fsync(fd, path)
    finally:
        os.close(fd)


def _is_main() -> bool:
    """Whether this process writes a checkpoint's shared files: rank 0, or each node's first with a launcher."""
    import torch.distributed as dist

    if "LOCAL_RANK" in os.environ:
        return os.environ["LOCAL_RANK"] == "0"
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def flush_tree(folder: Path, *, rank: int | None = None, main: bool | None = None) -> None:
    """fsync this rank's files under ``folder`` and every folder, so a marker never precedes their data.

    This rank's files: those named after ``rank`` (``writer_rank``), and, on the ``main`` process, the shared
    ones named after no rank; by default both come from the process group.
    """
    if not folder.is_dir():
        return
    rank = _rank() if rank is None else rank
    main = _is_main() if main is None else main
    for path in sorted(folder.rglob("*"), reverse=True):  # files before the folders that hold them
        if path.is_dir():
            fsync_dir(path)
            continue
        owner = writer_rank(str(path.relative_to(folder)))
        if (owner is None and not main) or (owner is not None and owner != rank):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            _fsync(fd, path)
        finally:
            os.close(fd)
    fsync_dir(folder)


def _files(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in (COMPLETE, f".{COMPLETE}.tmp", SAVING)
    }


def crc32(path: str | os.PathLike, chunk: int = 1 << 22) -> int:
    """CRC-32 of a file's bytes (measured 0.5 s per GB from the page cache, 1.1 s from disk): catches same-size damage."""
    value = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            value = zlib.crc32(block, value)
    return value


_RANK_FILE = re.compile(
    r"(?:^|/)(?:__(\d+)_\d+\.distcp|rng_state_(\d+)\.pth|(?:bf16_)?zero_pp_rank_(\d+)_[^/]*|random_states_(\d+)\.pkl)$"
)


def writer_rank(name: str) -> int | None:
    """The rank whose name a per-rank file carries (DCP shards, RNG states: the Trainer's ``rng_state_N.pth``, the
    loops' ``random_states_N.pkl``; DeepSpeed partitions), else None."""
    match = _RANK_FILE.search(name)
    return None if match is None else int(next(g for g in match.groups() if g is not None))


def checksums(directory: str | os.PathLike, names: Iterable[str]) -> dict[str, int]:
    """CRC-32 of each named file of ``directory`` (those that exist)."""
    root = Path(directory)
    return {name: crc32(root / name) for name in names if (root / name).is_file()}


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
    files = _files(out)
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
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(seal(body), handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, out / COMPLETE)
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
    from .._compat import numpy_rng_safe_globals

    try:
        with numpy_rng_safe_globals():
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # truncated zip, bad pickle, or a global outside the weights-only allow-list
        reason = " ".join(str(error).split())[:300]
        raise CheckpointError(f"{path.name} cannot be loaded safely (weights_only=True): {reason}") from error


def _in_deepspeed_folder(path: Path, root: Path) -> bool:
    """A file of a DeepSpeed checkpoint's tag folder (``global_stepN/`` next to its ``latest`` file)."""
    return path.parent != root and (path.parent.parent / "latest").is_file()


class _Stand:
    """Stands in for a DeepSpeed class while checking a file: built from its pickled state, never run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


# the classes DeepSpeed pickles into its checkpoints besides tensors and containers (loss scaler, ZeRO stage,
# parameter fragment addresses); DeepSpeed unpickles them in full, so nothing else may be in its files
DEEPSPEED_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def load_deepspeed_file(path: Path) -> Any:
    """A DeepSpeed file loaded ``weights_only``, its own classes stood in for (no DeepSpeed import, no code run)."""
    with torch.serialization.safe_globals([(_Stand, name) for name in DEEPSPEED_CLASSES]):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def check_deepspeed_file(path: Path) -> None:
    """CheckpointError when a DeepSpeed file holds anything but tensors, containers and DeepSpeed's own classes."""
    try:
        load_deepspeed_file(path)
    except Exception as error:  # a global outside torch's allow-list and DeepSpeed's classes, or a damaged file
        reason = " ".join(str(error).split())[:300]
        raise CheckpointError(
            f"{path.parent.name}/{path.name} holds more than DeepSpeed saves (it could run code when DeepSpeed "
            f"loads it): {reason}"
        ) from error


def check_deepspeed_latest(path: Path) -> None:
    """``latest`` must name a real tag folder directly beside it: DeepSpeed loads whatever folder it names."""
    size = path.stat().st_size
    if size > _LATEST_MAX:
        raise CheckpointError(
            f"{path.name} has {size} bytes, more than a DeepSpeed tag name ({_LATEST_MAX} at most): it is corrupted "
            "or crafted; pick another checkpoint"
        )
    try:
        tag = path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path.name} is corrupted (not a tag name: {error})") from error
    target = path.parent / tag
    if (
        not tag
        or "/" in tag
        or "\\" in tag
        or tag in (".", "..")
        or target.is_symlink()
        or not target.is_dir()
        or target.resolve().parent != path.parent.resolve()
    ):
        raise CheckpointError(
            f"{path.name} names {tag!r}, which is not a checkpoint folder beside it (a plain folder, not a link)"
        )


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
    from .safe_dcp import UnsafeCheckpointError, check_values, load_metadata

    try:
        check_values(path.parent, load_metadata(path))
    except (UnsafeCheckpointError, OSError) as error:
        raise CheckpointError(str(error)) from error
    except Exception as error:  # metadata of DCP's classes, holding values of unexpected types
        raise CheckpointError(
            f"{path.parent.name}/{path.name} is malformed ({type(error).__name__}: {error}); it is corrupted or crafted"
        ) from error


def _inside(src: Path, name: Any) -> Path:
    """``src / name`` for a marker's file name; CheckpointError unless it is a relative path inside ``src``."""
    path = src / name if isinstance(name, str) and name else None
    if (
        path is None
        or Path(name).is_absolute()
        or ".." in Path(name).parts
        or not path.resolve().is_relative_to(src.resolve())
    ):
        raise CheckpointError(
            f"{COMPLETE} lists {name!r}, which is not a file inside the checkpoint: corrupted or crafted"
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


def verify(
    directory: str | os.PathLike,
    *,
    require_marker: bool = True,
    part: tuple[int, int] = (0, 1),
    kind: str | None = None,
) -> dict[str, Any]:
    """Check a checkpoint: marker present and whole, file sizes and checksums as committed, the contents its kind
    needs (``kind``, else the marker's), every file it loads readable safely.

    ``part=(i, n)``: checksum only every n-th committed file from the i-th, so n processes share the reading.
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
            raise CheckpointError(f"no {COMPLETE} marker (missing, or interrupted while saving)")
        marker = {}
    check_contents(src, kind or marker.get("kind"))
    for path in src.rglob("*"):  # rglob does not enter linked folders: their files would go unchecked
        if path.is_symlink():
            raise CheckpointError(
                f"{path.relative_to(src)} is a symbolic link: a checkpoint holds plain files and folders only (a "
                "link lets the loader read files nobody checked); replace it with what it points to"
            )
    files, crcs = marker.get("files") or {}, marker.get("crc32") or {}
    for name, size in files.items():
        path = _inside(src, name)
        if not path.is_file():
            raise CheckpointError(f"{name} is missing (listed in {COMPLETE})")
        if path.stat().st_size != size:
            raise CheckpointError(f"{name} has {path.stat().st_size} bytes, {size} when committed (truncated?)")
    index, count = part
    for name, expected in sorted(crcs.items())[index::count]:
        if crc32(src / name) != expected:
            raise CheckpointError(f"{name} does not match its checksum in {COMPLETE} (corrupted after it was written)")
    for path in sorted(src.rglob("*")):
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            check_safetensors(path)
        elif path.name == ".metadata":
            check_dcp_metadata(path)  # DCP unpickles it in full: only its own classes may be in it
        elif path.name == "latest":
            check_deepspeed_latest(path)
        elif path.suffix in (".pt", ".pth", ".bin") and _in_deepspeed_folder(path, src):
            check_zip(path)  # DeepSpeed unpickles its files in full: whole, and weights-only with its own classes
            check_deepspeed_file(path)
        elif path.suffix in (".pt", ".pth", ".bin") and path.name not in _NOT_LOADED:
            check_torch_file(path)
        elif path.suffix == ".json":
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except ValueError as error:
                raise CheckpointError(f"{path.name} is not valid JSON ({error})") from error
    return marker


def sorted_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` folders of ``directory``, by step, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


def newest_complete(directory: str | os.PathLike, kind: str | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and one line per newer checkpoint skipped and why."""
    skipped: list[str] = []
    for path in reversed(sorted_checkpoints(directory)):
        try:
            verify(path, kind=kind)
        except CheckpointError as error:
            skipped.append(f"{path.name}: {error}")
            continue
        except Exception as error:  # malformed beyond what the checks foresee: still not one to resume from
            skipped.append(f"{path.name}: cannot be checked ({type(error).__name__}: {error})")
            continue
        return path, skipped
    return None, skipped


def rotate(directory: str | os.PathLike, limit: int | None, *, best: str | os.PathLike | None = None) -> list[Path]:
    """Keep at most ``limit`` complete checkpoints (transformers' rule); drop older saves that died early.

    Never deletes the newest complete checkpoint nor ``best``. Call it from one process per filesystem.
    Each deletion removes the marker first, so a half-deleted folder is never taken for a complete one.
    """
    if limit is None or limit <= 0:
        return []
    found = [p for p in sorted_checkpoints(directory) if not p.is_symlink()]  # never delete through a link
    complete = [p for p in found if is_complete(p)]
    if not complete:
        return []
    newest = complete[-1]
    protected = {newest.resolve()} | ({Path(best).resolve()} if best else set())
    # Not complete and older than the newest complete checkpoint: a save of ours that died (it carries the
    # in-progress tag, or a marker that is damaged) is removed, and so is a folder that never got as far as
    # trainer_state.json; a finished checkpoint written without trainer_ext (plain transformers) is never ours
    # to delete.
    doomed = [
        p
        for p in found
        if p not in complete
        and _step(p) < _step(newest)
        and p.resolve() not in protected
        and (has_marker(p) or (p / SAVING).exists() or not (p / TRAINER_STATE).exists())
    ]
    remaining = len(complete)
    for path in complete:
        if remaining <= max(limit, len(protected)):
            break
        if path.resolve() not in protected:
            doomed.append(path)
            remaining -= 1
    for path in doomed:
        remove_marker(path)
        shutil.rmtree(path, ignore_errors=True)
    return sorted(doomed, key=_step)


def _step(path: Path) -> int:
    return int(_CHECKPOINT.match(path.name).group(1))
