"""Which checkpoint a resume picks: what a ``resume_from_checkpoint`` value asks for, and the newest complete one.

The Trainer's ``resolve_resume``, the ``trainer-ext train`` job (through it) and the loops' ``load_state()``
choose here. A Trainer's checkpoints are ``checkpoint-N`` folders, newest step first; a loop's ``save_state``
folders are named by the user, newest commit first. Words are read alike whatever their case, here, in
``trainer_ext.train`` and on the command line (``HfArgumentParser`` leaves ``--resume_from_checkpoint true`` a
string).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch.distributed as dist

from trainer_ext.checkpointing.accelerate_format import is_accelerate_checkpoint
from trainer_ext.checkpointing.listing import sorted_checkpoints
from trainer_ext.checkpointing.marker import COMPLETE, LOOP, TRAINER, TRAINER_STATE, CheckpointError, has_marker
from trainer_ext.checkpointing.together import verify_together
from trainer_ext.errors import ConfigError
from trainer_ext.values import FALSE_WORDS, TRUE_WORDS

logger = logging.getLogger(__name__)

AUTO = "auto"
# the one boolean vocabulary (values.py), plus what only a resume request can mean
NEWEST_WORDS = (*TRUE_WORDS, "latest", "last")
NO_WORDS = (*FALSE_WORDS, "none", "")
NUMBERED_STATE = re.compile(r"checkpoint_(\d+)")  # a loop's folder named by automatic checkpoint naming


def resume_request(value: str | os.PathLike | bool | None) -> bool | str | None:
    """None (start fresh), True (the newest complete checkpoint, an error if none), ``"auto"`` (that one if any,
    else start fresh) or the checkpoint path as given."""
    if value is None or value is False:
        return None
    if value is True:
        return True
    word = str(value).strip().lower()
    if word in NO_WORDS:
        return None
    if word == AUTO:
        return AUTO
    if word in NEWEST_WORDS:
        return True
    return os.fspath(value)


def requested_checkpoint(value: str | os.PathLike | bool | None, *, flag: str | None = None) -> bool | str | None:
    """:func:`resume_request`, a path required to be a folder: ConfigError otherwise, in the words of the command
    line option ``flag`` when given (the job), else in transformers' words first (scripts match them)."""
    request = resume_request(value)
    if request is None or request is True or request == AUTO or os.path.isdir(request):
        return request
    if flag is not None:
        raise ConfigError(
            f"{flag} {request!r}: no such checkpoint directory. Pass a checkpoint-N folder, 'true' for the newest "
            "complete checkpoint in --output_dir, or 'auto' (that one if any, else start fresh)"
        )
    raise ConfigError(
        f"Can't find a valid checkpoint at {request}: no such directory. Pass a checkpoint-N folder, True (or "
        "'true', 'latest') for the newest complete checkpoint in output_dir, or 'auto' (that one if any, else "
        "start fresh)"
    )


def _committed(root: Path) -> list[Path]:
    """A loop's committed ``save_state`` folders under ``root``, newest commit first; a folder a crash left set
    aside or staged (``.NAME.saving``) stands for NAME, whose loader finds that complete copy and says so."""
    found = [d for d in root.iterdir() if (d / COMPLETE).is_file()] if root.is_dir() else []
    newest_first = sorted(found, key=lambda d: ((d / COMPLETE).stat().st_mtime_ns, d.name), reverse=True)
    named: list[Path] = []
    for folder in newest_first:
        for suffix in (".saving", ".replaced"):
            if folder.name.startswith(".") and folder.name.endswith(suffix):
                folder = folder.with_name(folder.name[1 : -len(suffix)])
                break
        if folder not in named:
            named.append(folder)
    return named


def newest_complete(
    directory: str | os.PathLike,
    kind: str | None = None,
    *,
    part: tuple[int, int] = (0, 1),
    verify: bool = True,
) -> tuple[Path | None, list[str]]:
    """The checkpoint a resume picks in ``directory``, and one line per newer one skipped and why.

    Numbered ``checkpoint-N`` folders (any ``kind`` but ``loop``): the newest that every rank verifies (a
    collective with a process group up; ``part`` splits the checksum reading, and rank 0's listing is walked by
    all). A directory in which no checkpoint has a marker was written without trainer_ext (plain transformers):
    there, as transformers does, the newest finished one (with ``trainer_state.json``) is taken, its files still
    verified; where markers exist, a folder without one is a save that did not finish. ``kind="loop"``: the
    ``save_state`` folder committed last (by its marker's time). ``verify=False``: the newest candidate, unchecked,
    with no collective (``load_state`` verifies what it loads).
    """
    root = Path(directory)
    if kind == LOOP:
        candidates, foreign = [p.name for p in _committed(root)], False
    else:
        found = sorted_checkpoints(root)
        candidates = [p.name for p in reversed(found)]
        foreign = bool(found) and not any(has_marker(p) for p in found)
    if not verify:
        return (root / candidates[0] if candidates else None), []
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [(candidates, foreign)]  # rank 0's listing: every rank must walk the same candidates
        dist.broadcast_object_list(box, src=0)
        candidates, foreign = box[0]
    skipped: list[str] = []
    for name in candidates:
        path = root / name
        try:
            if foreign and not (path / TRAINER_STATE).is_file():
                raise CheckpointError(f"no {TRAINER_STATE} (not a finished checkpoint)")
            verify_together(path, require_marker=not foreign, part=part, kind=kind)
        except CheckpointError as error:
            skipped.append(f"{name}: {error}")
            continue
        return path, skipped
    return None, skipped


def verify_requested(path: str | os.PathLike, *, part: tuple[int, int] = (0, 1)) -> bool:
    """Verify the checkpoint a resume names (every rank, agreeing); whether it has a marker. ConfigError when
    refused. In a run saved by trainer_ext (a sibling has a marker) a folder without one is a save that did not
    finish, or whose marker was lost; only a plain transformers run's checkpoint goes without."""
    ours = any(has_marker(p) for p in sorted_checkpoints(Path(path).parent))
    try:
        return bool(verify_together(path, require_marker=ours, part=part, kind=TRAINER))
    except CheckpointError as error:
        raise ConfigError(f"refusing to resume from {os.fspath(path)!r}: {error}") from error


def newest_own_state(root: Path) -> Path:
    """The ``save_state`` folder of ours under ``root`` committed last; a clear error if none."""
    chosen, _ = newest_complete(root, LOOP, verify=False)
    if chosen is None:
        raise ConfigError(
            f"load_state(): no complete checkpoint under {os.fspath(root)!r}; call save_state() first, or pass the "
            "checkpoint directory"
        )
    return chosen


def numbered_states(root: Path) -> list[tuple[int, Path]]:
    """The ``checkpoint_<n>`` folders automatic checkpoint naming wrote under ``root``, with their numbers."""
    found = (NUMBERED_STATE.fullmatch(entry.name) for entry in root.iterdir() if entry.is_dir())
    return [(int(match.group(1)), root / match.group(0)) for match in found if match]


def _saved_at(folder: Path) -> int:
    """When a loop's checkpoint was committed: its marker's time (ours), else its newest file's (accelerate's)."""
    if (folder / COMPLETE).is_file():
        return (folder / COMPLETE).stat().st_mtime_ns
    if not folder.is_dir():  # ours, interrupted while replacing it: its complete copy is beside it
        copies = (folder.with_name(f".{folder.name}{end}") / COMPLETE for end in (".saving", ".replaced"))
        return max((marker.stat().st_mtime_ns for marker in copies if marker.is_file()), default=0)
    return max((entry.stat().st_mtime_ns for entry in folder.iterdir() if entry.is_file()), default=0)


def newest_state(root: str | os.PathLike) -> Path:
    """The checkpoint ``load_state()`` resumes under ``root``: the ``save_state`` folder of ours committed last
    (:func:`newest_complete` with ``kind="loop"``), or accelerate's highest ``checkpoint_<n>`` (its rule) when that
    one is newer (a job started under accelerate). ConfigError when there is neither."""
    root = Path(root)
    found = numbered_states(root) if root.is_dir() else []
    theirs = [pair for pair in found if is_accelerate_checkpoint(pair[1])]
    if not theirs:
        return newest_own_state(root)
    newest = max(theirs)[1]
    try:
        ours = newest_own_state(root)
    except ConfigError:
        return newest
    mine, other = NUMBERED_STATE.fullmatch(ours.name), NUMBERED_STATE.fullmatch(newest.name)
    if mine is not None and other is not None:
        return ours if int(mine.group(1)) > int(other.group(1)) else newest
    return ours if _saved_at(ours) >= _saved_at(newest) else newest
