"""The run's event log, ``trainer_ext_events.jsonl``: starts (and resumes), log times, checkpoints and the end.

``trainer_state.json`` holds the curves but not when a run was interrupted and resumed: a resumed Trainer reloads
the checkpoint's history and carries on as if nothing happened. Jobs run by ``train(args)`` / ``trainer-ext train``
append one JSON line per event here (main process only, a few hundred bytes per logging step) so that the report can
mark resumes, restarts and wall-clock time. A plain ``trainer_ext.Trainer`` never writes it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

EVENTS_FILE = "trainer_ext_events.jsonl"


def append_event(output_dir: str | os.PathLike, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event (``{"event": kind, "time": ..., **fields}``) and return it."""
    event = {"event": kind, "time": round(time.time(), 3), **fields}
    path = Path(output_dir) / EVENTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(event, default=str) + "\n")
    return event


def start_fresh(output_dir: str | os.PathLike) -> None:
    """Forget the events of a replaced run (a fresh start in a folder that held one, e.g. --overwrite_output_dir)."""
    (Path(output_dir) / EVENTS_FILE).unlink(missing_ok=True)


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The events recorded in ``run_dir``, oldest first; a torn last line (a kill mid-write) is skipped."""
    path = Path(run_dir) / EVENTS_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def this_process() -> dict[str, Any]:
    """Who is training: host and process id, to tell a run in progress from an interrupted one."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def process_alive(event: dict[str, Any]) -> bool | None:
    """Whether the process that wrote ``event`` still runs: True/False on this host, None on another host."""
    if event.get("host") != socket.gethostname():
        return None
    pid = event.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():  # this process is not training while it reports
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    """A killed child not yet reaped still has a pid; /proc says it is a zombie (Linux only, else assume alive)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return status.rsplit(")", 1)[-1].split()[0] != "Z"


def seconds_since(event: dict[str, Any]) -> float:
    return time.time() - float(event.get("time", 0.0))
