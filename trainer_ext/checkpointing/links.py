"""The link rule: trainer_ext never writes, truncates or deletes through a symbolic link.

Every file and folder a job writes (checkpoints, markers, the run file, the lock, reports) is checked with
``lstat`` before it is written; a link there is refused with one line naming it, and removing an entry removes
the link itself, never what it points to.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trainer_ext.errors import ConfigError


def is_link(path: str | os.PathLike) -> bool:
    """True when ``path`` itself is a symbolic link (dangling or not)."""
    return os.path.islink(path)


def refuse_link(path: str | os.PathLike, what: str = "this path") -> None:
    """Raise ConfigError when ``path`` is a symbolic link: writing there would change the link's target."""
    if os.path.islink(path):
        raise ConfigError(
            f"{str(path)!r} ({what}) is a symbolic link to {os.readlink(path)!r}; trainer_ext never writes through "
            "a link. Remove the link or pick another --output_dir, and run again"
        )


def links_under(folder: str | os.PathLike) -> list[Path]:
    """Every symbolic link inside ``folder`` (not following links), sorted; [] when it does not exist."""
    found: list[Path] = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            path = Path(root, name)
            if path.is_symlink():
                found.append(path)
    return sorted(found)


def refuse_links_under(folder: str | os.PathLike, what: str = "a checkpoint") -> None:
    """refuse_link on ``folder`` and on everything inside it."""
    refuse_link(folder, what)
    for path in links_under(folder):
        refuse_link(path, f"inside {what}")


def open_no_follow(path: str | os.PathLike, flags: int, mode: int = 0o644, what: str = "this path") -> int:
    """``os.open`` that refuses (ConfigError) instead of following a link at ``path``."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as error:
        if os.path.islink(path):
            refuse_link(path, what)
        raise error


def remove_entry(path: str | os.PathLike) -> None:
    """Remove ``path``: a link (to a file or a folder) is unlinked, a folder deleted, a file removed."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def move_into(fresh: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Move everything ``fresh`` holds into ``dest`` by renames: a link in ``dest`` is replaced, never written
    through; a folder merges into a plain folder of the same name. ``fresh`` is left empty."""
    fresh, dest = Path(fresh), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for entry in sorted(fresh.iterdir()):
        target = dest / entry.name
        if entry.is_dir() and not entry.is_symlink():
            if target.is_dir() and not target.is_symlink():
                move_into(entry, target)
                entry.rmdir()
                continue
            if target.is_symlink():
                os.unlink(target)  # a link where a folder goes: the link goes, its target stays
        os.replace(entry, target)  # rename(2) replaces a link itself
