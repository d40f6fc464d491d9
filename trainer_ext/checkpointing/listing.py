"""The checkpoints of an output folder: listed by step, and safe rotation (which one a resume picks: .selection)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from trainer_ext.checkpointing.marker import SAVING, TRAINER_STATE, has_marker, is_complete, remove_marker

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def sorted_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` folders of ``directory``, by step, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


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
