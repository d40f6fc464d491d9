"""A checkpoint's files on disk: made durable (fsync), owned by the rank that writes them, checksummed.

The commit marker (:mod:`.marker`) is written only after every file it lists is durable, and lists their CRC-32.
"""

from __future__ import annotations

import errno
import os
import re
import zlib
from collections.abc import Iterable
from pathlib import Path

from trainer_ext.checkpointing import deepspeed_files
from trainer_ext.env_vars import LOCAL_RANK

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


def _fsync_path(path: Path, skip: type[OSError]) -> None:
    """fsync the file or folder at ``path``; one that cannot be opened with ``skip`` is left alone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except skip:
        return
    try:
        _fsync(fd, path)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename, creation or removal inside ``path`` durable (no-op where directories cannot be opened)."""
    _fsync_path(path, OSError)


def _is_main() -> bool:
    """Whether this process writes a checkpoint's shared files: rank 0, or each node's first with a launcher."""
    import torch.distributed as dist

    if LOCAL_RANK in os.environ:
        return os.environ[LOCAL_RANK] == "0"
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
        _fsync_path(path, FileNotFoundError)  # a file another rank removed meanwhile needs nothing
    fsync_dir(folder)


def crc32(path: str | os.PathLike, chunk: int = 1 << 22) -> int:
    """CRC-32 of a file's bytes (measured 0.5 s per GB from the page cache, 1.1 s from disk): catches same-size damage."""
    value = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            value = zlib.crc32(block, value)
    return value


_RANK_FILE = re.compile(
    rf"(?:^|/)(?:__(\d+)_\d+\.distcp|rng_state_(\d+)\.pth|{deepspeed_files.RANK_FILE}|random_states_(\d+)\.pkl)$"
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
