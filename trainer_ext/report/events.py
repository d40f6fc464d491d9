"""The run's event log, ``trainer_ext_events.jsonl``: starts (and resumes), log times, checkpoints and the end.

``trainer_state.json`` holds the curves but not when a run was interrupted and resumed: a resumed Trainer reloads
the checkpoint's history and carries on as if nothing happened. Jobs run by ``train(args)`` / ``trainer-ext train``
append one JSON line per event here (main process only, a few hundred bytes per logging step) so that the report can
mark resumes, restarts and wall-clock time. A plain ``trainer_ext.Trainer`` never writes it.
"""

from __future__ import annotations

import json
import math
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
        event = _clean(event)
        if event is not None:
            events.append(event)
    return events


# the typed fields of an event; a field of another type (a hand-edited or foreign log) is dropped, not trusted
_INT_FIELDS = ("step", "pid", "max_steps", "world_size", "per_device_batch", "accumulation", "global_batch")
_STR_FIELDS = ("event", "host", "strategy", "precision", "status", "checkpoint", "metric_for_best_model")
_BOOL_FIELDS = ("resumed", "greater_is_better")


def _clean(event: Any) -> dict[str, Any] | None:
    """``event`` with its malformed fields dropped, or None when it is not an event (no kind, no valid time)."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return None
    when = event.get("time")
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        return None
    out = dict(event)
    for name in _INT_FIELDS:
        if name in out and (type(out[name]) is not int or out[name] < 0):
            del out[name]
    for name in _STR_FIELDS:
        if name in out and not isinstance(out[name], str):
            del out[name]
    for name in _BOOL_FIELDS:
        if name in out and not isinstance(out[name], bool):
            del out[name]
    if "argv" in out and not (isinstance(out["argv"], list) and all(isinstance(w, str) for w in out["argv"])):
        del out["argv"]
    return out


def this_process() -> dict[str, Any]:
    """Who is training: host and process id, to tell a run in progress from an interrupted one."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def process_alive(event: dict[str, Any], *, this_one_trains: bool = False) -> bool | None:
    """Whether the process that wrote ``event`` still runs: True/False on this host, None on another host.

    ``this_one_trains``: the caller is the training process itself (the report written at a checkpoint), so an
    event written by this very process is a run in progress; otherwise a process reporting on itself is not training.
    """
    if event.get("host") != socket.gethostname():
        return None
    pid = event.get("pid")
    if not isinstance(pid, int):
        return False
    if pid == os.getpid():
        return this_one_trains
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
