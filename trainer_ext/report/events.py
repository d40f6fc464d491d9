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

from trainer_ext.report.reading import EVENTS_MAX_BYTES, Unreadable, read_bytes

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


def read_events(run_dir: str | os.PathLike, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """The events recorded in ``run_dir``, oldest first; a torn last line (a kill mid-write) is skipped.

    A line that is not an event (not JSON, nested too deep, no kind, a time that is no plausible clock reading) is
    skipped, and so is a log that cannot be read safely (see :mod:`.reading`); ``notes`` gets a line saying so.
    """
    path = Path(run_dir) / EVENTS_FILE
    try:
        data = read_bytes(path, EVENTS_MAX_BYTES)
    except Unreadable as why:
        _note(notes, f"{why}; the report shows no sessions, resumes or times")
        return []
    lines = (data or b"").decode("utf-8", errors="replace").splitlines()
    events, bad = [], 0
    for index, line in enumerate(lines):
        try:
            event = _clean(json.loads(line))
        except RecursionError:  # nested too deep: no event
            event = None
        except ValueError:
            event = None
            if index == len(lines) - 1:  # a torn last line: the normal end of a killed run, not worth a note
                continue
        if event is None:
            bad += 1
        else:
            events.append(event)
    if bad:
        _note(notes, f"{bad:,} line{'s' if bad > 1 else ''} of {path} skipped (not an event with a valid time)")
    return events


def _note(notes: list[str] | None, text: str) -> None:
    if notes is not None:
        notes.append(text)


# the typed fields of an event; a field of another type (a hand-edited or foreign log) is dropped, not trusted
_INT_FIELDS = ("step", "pid", "max_steps", "world_size", "per_device_batch", "accumulation", "global_batch")
_STR_FIELDS = ("event", "host", "strategy", "precision", "status", "checkpoint", "metric_for_best_model")
_BOOL_FIELDS = ("resumed", "greater_is_better")
# an event time is a Unix time: 1970 to 2286 (a time outside is a broken clock or a crafted file, and is no date)
EARLIEST, LATEST = 0.0, 1e10
# the largest count (step, pid, batch) taken: exact as a float, so it can be drawn and compared
MAX_COUNT = 2**53


def _clean(event: Any) -> dict[str, Any] | None:
    """``event`` with its malformed fields dropped, or None when it is not an event (no kind, no valid time)."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return None
    when = event.get("time")
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not EARLIEST <= when <= LATEST:
        return None
    out = dict(event)
    for name in _INT_FIELDS:
        if name in out and not (type(out[name]) is int and 0 <= out[name] <= MAX_COUNT):
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
