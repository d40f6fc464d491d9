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
from trainer_ext.checkpointing.listing import sorted_checkpoints
from trainer_ext.checkpointing.marker import TRAINER, TRAINER_STATE, CheckpointError, has_marker
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


def agreed(work: Callable[[], T], describe: Callable[[Exception], str], failed: Callable[[str], Exception]) -> T:
    """``work()`` on every rank, then agree: when it failed anywhere every rank raises (none goes on, or waits for
    a dead one, alone). The rank that failed re-raises its own error; the others raise ``failed`` of the ranks'
    ``describe``d errors, joined."""
    error: Exception | None = None
    result: Any = None
    try:
        result = work()
    except Exception as exc:  # reported to every rank below, then re-raised here
        error = exc
    failures = [line for lines in _all([describe(error)] if error is not None else []) for line in lines]
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


def verify_together(
    directory: str | os.PathLike,
    *,
    require_marker: bool = True,
    part: tuple[int, int] = (0, 1),
    kind: str | None = None,
) -> dict[str, Any]:
    """``verification.verify`` with the checksums split by ``part`` (this rank's index among its node's); all agree.

    CheckpointError on every rank when any rank found a problem.
    """
    try:
        found, problem = verify(directory, require_marker=require_marker, part=part, kind=kind), None
    except CheckpointError as error:
        found, problem = {}, str(error)
    except Exception as error:  # unreadable, or malformed beyond what the checks foresee: no rank may wait alone
        found, problem = {}, f"cannot be checked ({type(error).__name__}: {' '.join(str(error).split())[:300]})"
    problems = [p for p in _all(problem) if p is not None]
    if problems:
        raise CheckpointError(problems[0])
    return found


def newest_complete_together(
    directory: str | os.PathLike, *, part: tuple[int, int] = (0, 1)
) -> tuple[Path | None, list[str]]:
    """The newest checkpoint every rank verifies, and one line per newer one skipped and why (same on all ranks).

    A directory in which no checkpoint has a marker was written without trainer_ext (plain transformers): there,
    as transformers does, the newest finished checkpoint (one with ``trainer_state.json``) is taken, its files
    still verified. Where markers exist, a folder without one is a save that did not finish.
    """
    found = sorted_checkpoints(directory)
    candidates = [p.name for p in reversed(found)]
    foreign = bool(found) and not any(has_marker(p) for p in found)
    rank, world = _world()
    if world > 1:  # rank 0's listing: every rank must walk the same candidates
        box = [(candidates, foreign)]
        dist.broadcast_object_list(box, src=0)
        candidates, foreign = box[0]
    skipped: list[str] = []
    for name in candidates:
        path = Path(directory) / name
        try:
            if foreign and not (path / TRAINER_STATE).is_file():
                raise CheckpointError(f"no {TRAINER_STATE} (not a finished checkpoint)")
            verify_together(path, require_marker=not foreign, part=part, kind=TRAINER)
        except CheckpointError as error:
            skipped.append(f"{name}: {error}")
            continue
        return path, skipped
    return None, skipped
