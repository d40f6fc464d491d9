"""An advisory lock on a job's output folder, so that two jobs never write into the same checkpoints.

The main process of ``trainer_ext.train`` / ``trainer-ext train`` holds ``flock`` on ``OUTPUT_DIR/.trainer_ext.lock``
for the life of the process; the file names the holder (PID, host, start time) for the error a second job gets.
The operating system releases the lock when the process ends, however it ends, so a crashed job never leaves a
stale lock: the file stays, the lock does not.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from trainer_ext.checkpointing.links import open_no_follow
from trainer_ext.errors import ConfigError

LOCK_FILE = ".trainer_ext.lock"
_held: dict[Path, int] = {}  # output folder (resolved) -> the open descriptor that holds its lock


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the file."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode("utf-8") or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another process (it has not written its name yet)"
    return f"PID {info.get('pid')} on {info.get('host', '?')}, since {info.get('started', '?')}"


def acquire(directory: str | os.PathLike) -> None:
    """Take the lock of ``directory`` (created if needed) for this process; ConfigError naming the holder if taken."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    if key in _held:
        return
    fd = open_no_follow(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, what="the run lock")  # a link: refused
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        raise ConfigError(
            f"{str(folder)!r} is in use by another run ({holder}): two runs in one output_dir would write the same "
            "checkpoints. Wait for it to end, stop it, or pick another --output_dir"
        ) from None
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started})
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode("utf-8"), 0)
    _held[key] = fd


def release(directory: str | os.PathLike) -> None:
    """Give the lock of ``directory`` back (the end of the process does it too)."""
    fd = _held.pop(Path(directory).resolve(), None)
    if fd is not None:
        os.ftruncate(fd, 0)
        os.close(fd)  # closing the descriptor releases the flock
