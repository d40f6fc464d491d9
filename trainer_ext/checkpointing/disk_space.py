"""A full disk said in words: how much room a save needs, how much there is, and the error when it runs out.

Without this, a full disk shows as ``OSError: [Errno 28]`` at start or, from inside ``torch.save``, as
``RuntimeError: basic_ios::clear: iostream error``, which never says "disk full".
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from trainer_ext.errors import ConfigError
from trainer_ext.values import format_size

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# what torch's and safetensors' writers say when a write fails (their errors carry no errno)
_FULL_WORDS = ("No space left", "iostream error", "file write failed", "Disk quota exceeded", "write failed")
SLACK = 1 << 20  # bytes for the small files of a checkpoint (state, scheduler, RNG, marker)


class DiskFullError(ConfigError):
    """No room left where a run writes: the message names the folder, the free space and what was needed."""


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


def checkpoint_bytes(model: Any, optimizer_states: int = 2) -> int:
    """About what one checkpoint of ``model`` takes: its weights as stored, plus ``optimizer_states`` fp32 copies
    of the trainable parameters (AdamW's two moments), plus the small files."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return weights + optimizer_states * 4 * trainable + SLACK


def check_room(path: str | os.PathLike, needed: int, what: str) -> None:
    """DiskFullError before anything is written when ``path``'s file system has less than ``needed`` bytes free."""
    free = free_bytes(path)
    if free < needed:
        raise DiskFullError(
            f"not enough disk space for {what} in {str(path)!r}: {format_size(free)} free, about "
            f"{format_size(needed)} needed. Free some space there or pick another --output_dir"
        )


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a write that failed for lack of space."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
            return True
        if any(words in str(error) for words in _FULL_WORDS):  # torch's RuntimeError, safetensors' own error
            return True
        error = error.__cause__ or error.__context__
    return False


def save_failed(path: str | os.PathLike, error: BaseException, needed: int | None, kept: str | None) -> DiskFullError:
    """The error for a save into ``path`` that ran out of space; ``kept`` names what is still intact."""
    need = f", about {format_size(needed)} needed" if needed else ""
    intact = f"; {kept} is intact" if kept else ""
    return DiskFullError(
        f"no space left on the device while writing {str(path)!r} ({format_size(free_bytes(path))} free{need}); "
        f"the unfinished save was removed{intact}. Free some space and resume with --resume_from_checkpoint true"
    )
