"""What the ranks of a job do together for a checkpoint: checksum their own files, share the verification, agree.

Every function here is a collective when a process group is up (every rank must call it) and plain local work
otherwise. The reading is spread: each rank checksums the per-rank files it wrote, and on resume the ranks of a
node split the committed files between them; all ranks then take the same decision.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from trainer_ext.checkpointing.durable import checksums, writer_rank
from trainer_ext.checkpointing.marker import CheckpointError
from trainer_ext.checkpointing.verification import verify


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all(value: Any) -> list[Any]:
    """``value`` from every rank (a collective with more than one process)."""
    rank, world = _world()
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


T = TypeVar("T")


def agreed(
    work: Callable[[], T],
    describe: Callable[[Exception], str],
    failed: Callable[[str], Exception],
    *,
    alike: bool = False,
) -> T:
    """``work()`` on every rank, then agree: when it failed anywhere every rank raises (none goes on, or waits for
    a dead one, alone). The rank that failed re-raises its own error; the others raise ``failed`` of the ranks'
    ``describe``d errors, joined. With ``alike`` every rank, the failing ones too, raises ``failed`` of the first
    failing rank's description: the same error everywhere, so that what the ranks decide from it cannot differ."""
    error: Exception | None = None
    result: Any = None
    try:
        result = work()
    except Exception as exc:  # reported to every rank below, then re-raised here
        error = exc
    failures = [line for lines in _all([describe(error)] if error is not None else []) for line in lines]
    if alike and failures:
        raise failed(failures[0])
    if error is not None:
        raise error
    if failures:
        raise failed("; ".join(failures))
    return result


def own_checksums(folder: str | os.PathLike) -> dict[str, int]:
    """CRC-32 of the per-rank files (named after their rank) each rank wrote, read back by that rank, merged."""
    rank, _ = _world()
    root = Path(folder)
    names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
    mine = checksums(root, [name for name in names if writer_rank(name) == rank])
    merged: dict[str, int] = {}
    for part in _all(mine):
        merged.update(part)
    return merged


def _said(error: Exception) -> str:
    """A verification's refusal as one line: its own words, or what kept the folder from being checked."""
    if isinstance(error, CheckpointError):
        return str(error)
    return f"cannot be checked ({type(error).__name__}: {' '.join(str(error).split())[:300]})"


def verify_together(
    directory: str | os.PathLike,
    *,
    require_marker: bool = True,
    part: tuple[int, int] = (0, 1),
    kind: str | None = None,
) -> dict[str, Any]:
    """``verification.verify`` with the checksums split by ``part`` (this rank's index among its node's); all agree.

    CheckpointError on every rank, with the first problem found, when any rank found one (a folder unreadable or
    malformed beyond what the checks foresee included: no rank may wait alone).
    """
    return agreed(
        lambda: verify(directory, require_marker=require_marker, part=part, kind=kind),
        _said,
        CheckpointError,
        alike=True,
    )
