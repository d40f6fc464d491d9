"""How every checkpoint is committed: tag -> save -> flush -> barrier -> checksums -> marker -> rotate.

The Trainer's ``checkpoint-N`` and the loops' ``save_state`` folder both go through :func:`commit`. The save is
tagged as in progress first: in place, a ``.trainer_ext_saving`` file in the folder (what an earlier save left
there is cleared); ``staged``, a fresh hidden sibling ``.NAME.saving`` that takes the folder's place only once
committed, the previous folder set aside (``.NAME.replaced``) and removed after, so a failed save leaves it as it
was. Every rank then writes its share and fsyncs it; after the ranks meet, each checksums the per-rank files it
wrote, and the main process writes the ``COMPLETE`` marker (sizes, checksums) last, ends the tag and rotates.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer_ext.checkpointing.durable import flush_tree, fsync_dir
from trainer_ext.checkpointing.marker import (
    CheckpointError,
    begin_save,
    end_save,
    is_complete,
    remove_marker,
    write_marker,
)
from trainer_ext.checkpointing.together import agreed, own_checksums

SAVING_SUFFIX, SET_ASIDE_SUFFIX = ".saving", ".replaced"


def staging(final: Path) -> Path:
    """Where a staged save of ``final`` is written before it is swapped in."""
    return final.parent / f".{final.name}{SAVING_SUFFIX}"


def set_aside(final: Path) -> Path:
    """Where the previous ``final`` waits while a staged save takes its place."""
    return final.parent / f".{final.name}{SET_ASIDE_SUFFIX}"


def recover(final: Path) -> None:
    """Finish a swap that a crash interrupted (main process, before a save): the newest complete folder wins."""
    if not final.exists():
        for candidate in (staging(final), set_aside(final)):
            if is_complete(candidate):
                os.replace(candidate, final)
                fsync_dir(final.parent)
                break
    for leftover in (staging(final), set_aside(final)):
        if leftover.exists():
            remove_marker(leftover)
            shutil.rmtree(leftover)


def swap_in(staged: Path, final: Path) -> None:
    """Put the committed ``staged`` folder in the place of ``final``; the previous one goes only after."""
    previous = set_aside(final)
    if final.exists():
        os.replace(final, previous)
    os.replace(staged, final)
    fsync_dir(final.parent)
    if previous.exists():
        remove_marker(previous)
        shutil.rmtree(previous)


def _clear(folder: Path) -> None:
    """A dead save in ``folder``, or an older one of the same name: removed whole, nothing of it reused."""
    if folder.is_dir():
        remove_marker(folder)  # first: a half-cleared folder is never taken for a complete one
        shutil.rmtree(folder)  # the caller's check refused links in it: nothing outside the folder is touched


def commit(
    folder: str | os.PathLike,
    save: Callable[[Path], None],
    *,
    main: bool,
    marker: dict[str, Any],
    staged: bool = False,
    check: Callable[[], None] | None = None,
    rotate: Callable[[Path], None] | None = None,
    barrier: Callable[[], None] | None = None,
    on_error: Callable[[BaseException, Path], None] | None = None,
    describe: Callable[[Exception], str] = str,
    failed: Callable[[str, str], Exception] | None = None,
) -> Path:
    """Every rank: commit a checkpoint into ``folder``; returns it.

    ``check()`` runs first on every rank (the link rule, what may be replaced); then the tag (``main``: the
    process that writes the shared files, the marker, and rotates), ``save(where)`` on every rank (``where`` is
    ``folder``, or its staging folder), the fsync of this rank's files, the checksums, the marker (``marker``:
    ``world_size``, ``kind``, ``step`` and facts, see ``marker.write_marker``) and ``rotate(folder)``.

    The tag is agreed: a rank that fails it re-raises its error, the others raise ``failed(stage, lines)`` of the
    ranks' ``describe``d errors. Writing and committing are agreed the same way, unless ``barrier`` is given: then
    the ranks meet at it after each step (a save holding the backend's own collectives: a rank that fails there
    raises alone, and the launcher ends the job). ``on_error(error, where)`` may replace an error of the writing
    or of the marker (a full disk said in one line) before it is raised.
    """
    final = Path(folder)
    where = staging(final) if staged else final

    def stage(name: str, work: Callable[[], None], *, agree: bool) -> None:
        if agree or barrier is None:
            agreed(work, describe, lambda lines: (failed or _failed)(name, lines))
        else:
            work()
        if barrier is not None:
            barrier()

    def tag() -> None:
        if check is not None:
            check()
        if not main:
            return
        if staged:
            final.parent.mkdir(parents=True, exist_ok=True)
            recover(final)
            where.mkdir()
        else:
            _clear(final)
            begin_save(final)  # until the marker: a save in progress, or one that died (rotation)

    def write() -> None:
        try:
            save(where)
            flush_tree(where)  # this rank's data reaches the disk before the marker can
        except Exception as error:  # torch, safetensors and the OS each say "disk full" with their own error type
            if on_error is not None:
                on_error(error, where)
            raise

    def seal() -> None:
        crcs = own_checksums(where)  # collective: each rank reads back the per-rank files it wrote
        if not main:
            return
        try:
            write_marker(where, crcs=crcs, **marker)
        except OSError as error:
            if on_error is not None:
                on_error(error, where)
            raise
        if staged:
            swap_in(where, final)
        else:
            end_save(final)
        if rotate is not None:
            rotate(final)

    stage("preparing", tag, agree=True)
    stage("writing", write, agree=False)
    stage("committing", seal, agree=False)
    return final


def _failed(stage: str, lines: str) -> Exception:
    return CheckpointError(f"the checkpoint failed while {stage} on {lines}")
