"""A checkpoint folder checked by hand: every way it differs from its marker (:func:`audit`), and a folder changed
on purpose (re-sharded weights, say) checked afresh and committed with a new marker (:func:`seal_checkpoint`).

``trainer-ext checkpoint verify|seal`` is the command line over these; resume runs :func:`.verification.verify`,
which stops at the first problem, where :func:`audit` lists them all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer_ext.checkpointing.durable import writer_rank
from trainer_ext.checkpointing.listing import sorted_checkpoints
from trainer_ext.checkpointing.marker import (
    COMPLETE,
    LOOP,
    MARKER_CRC,
    MARKER_FORMAT,
    SAVING,
    TRAINER,
    TRAINER_STATE,
    CheckpointError,
    listed_files,
    read_marker,
    write_marker,
)
from trainer_ext.checkpointing.verification import LOOP_STATE, SEAL_COMMAND, WEIGHTS, Problem, find_problems
from trainer_ext.errors import ConfigError

_NOT_FACTS = (MARKER_FORMAT, "files", "crc32", MARKER_CRC)  # what a marker records of the files, not of the run


@dataclass
class Audit:
    """What :func:`audit` found: the marker when it is whole, and every problem (the marker's own first)."""

    folder: Path
    marker: dict[str, Any] | None
    kind: str | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the folder verifies: marker whole, files exactly as committed, each loadable."""
        return not self.problems


@dataclass
class Sealed:
    """What :func:`seal_checkpoint` did: the marker now in the folder, whether it was already valid (nothing
    written), and whether the run's facts (world size, strategy, batch sizes) came from the previous marker."""

    marker: dict[str, Any]
    already: bool
    facts_kept: bool


def _folder(directory: str | os.PathLike) -> Path:
    """``directory`` as a Path; ConfigError unless it is a plain folder (a link would be written through)."""
    src = Path(directory)
    if src.is_symlink():
        raise ConfigError(
            f"{directory} is a symbolic link: a checkpoint is a plain folder; pass the folder itself ({src.resolve()})"
        )
    if not src.exists():
        raise ConfigError(f"{directory}: no such folder; pass a checkpoint folder (checkpoint-N)")
    if not src.is_dir():
        raise ConfigError(f"{directory} is not a folder; pass a checkpoint folder (checkpoint-N)")
    return src


def guess_kind(directory: str | os.PathLike) -> str | None:
    """The kind of checkpoint a folder without a valid marker looks like, by its state file (an Accelerator state
    holds a ``model.safetensors`` too), else by its weights; None when it has neither."""
    src = Path(directory)
    if (src / TRAINER_STATE).is_file():
        return TRAINER
    if (src / LOOP_STATE).is_file():
        return LOOP
    return TRAINER if any((src / name).is_file() for name in WEIGHTS) else None


def _unmarked_kind(src: Path) -> str:
    """The kind of a folder without a valid marker; ConfigError when it is no checkpoint, or an output folder
    (its final model and ``trainer_state.json`` beside ``checkpoint-N`` folders)."""
    inner = sorted_checkpoints(src)
    kind = guess_kind(src)
    if kind is None or inner:
        newest = f"; the newest in it is {inner[-1]}" if inner else ""
        raise ConfigError(
            f"{src} is not a checkpoint (no valid {COMPLETE} marker, "
            + ("and it holds checkpoint folders" if inner else f"no {TRAINER_STATE}, weights or {LOOP_STATE}")
            + f"): pass a checkpoint-N folder{newest}"
        )
    return kind


def audit(directory: str | os.PathLike) -> Audit:
    """Every problem of a checkpoint folder: its marker missing or damaged, each file missing, resized, changed or
    added since the marker, links, and each file that would not load. ConfigError when it is not a checkpoint."""
    src = _folder(directory)
    try:
        marker, problems = read_marker(src), []
    except CheckpointError as error:
        marker, problems = None, [Problem(str(error))]
    kind = marker.get("kind") if marker is not None else _unmarked_kind(src)
    if marker is None and not problems:
        unfinished = f"its save did not finish: {SAVING} is there" if (src / SAVING).exists() else "never written"
        problems.append(Problem(f"no {COMPLETE} marker ({unfinished}, or removed)"))
    problems += find_problems(src, marker or {}, kind=kind, extra=marker is not None)
    return Audit(src, marker, kind, problems)


def _facts(src: Path, old: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    """The run's facts for the new marker: the previous marker's when it is whole, else what the files say."""
    if old is not None:
        facts = {key: value for key, value in old.items() if key not in _NOT_FACTS}
    else:  # per-rank files are named after their rank (rng_state_N.pth, DCP shards, ...): one without is 1 process
        ranks = [rank for name in listed_files(src) if (rank := writer_rank(name)) is not None]
        facts = {"world_size": max(ranks, default=0) + 1, "step": None}
    facts["kind"] = kind
    if kind == TRAINER:  # the step the Trainer resumes at
        facts["step"] = json.loads((src / TRAINER_STATE).read_text(encoding="utf-8")).get("global_step", 0)
    return facts


def seal_checkpoint(directory: str | os.PathLike) -> Sealed:
    """Check a checkpoint folder's files as they are now and commit them with a fresh marker (written atomically,
    through no link), so it can be resumed. ConfigError, with nothing written, when the folder is not a whole,
    loadable checkpoint.

    What it must hold is what resume needs (:func:`.verification.check_contents`, and each file loadable): a Trainer
    checkpoint its ``trainer_state.json`` with a ``global_step`` and its weights (a sharded index consistent with its
    shards); an Accelerator state process 0's random states. No file may be a symbolic link.
    """
    src = _folder(directory)
    try:
        old = read_marker(src)
    except CheckpointError:
        old = None  # damaged: neither its file table nor its facts can be trusted
    if old is None and (src / SAVING).exists():
        raise ConfigError(
            f"cannot seal {src}: a save into it did not finish ({SAVING} is there), so files may be missing; "
            "resume from an earlier checkpoint"
        )
    kind = (old or {}).get("kind") or _unmarked_kind(src)
    if old is not None and next(find_problems(src, old, kind=kind, extra=True), None) is None:
        return Sealed(old, already=True, facts_kept=True)
    problems = list(find_problems(src, {}, kind=kind))
    if problems:
        more = len(problems) - 1
        rest = f" (and {more} more: `{SEAL_COMMAND.replace('seal', 'verify')} {src}` lists them)" if more else ""
        raise ConfigError(f"cannot seal {src}: {problems[0].text}{rest}")
    write_marker(src, **_facts(src, old, kind))
    return Sealed(read_marker(src) or {}, already=False, facts_kept=old is not None)
