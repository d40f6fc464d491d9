"""Read a run folder into :class:`RunData`: the log history, checkpoints, resumes and what the job was.

A run folder is an ``output_dir`` of ``transformers.Trainer`` (``trainer_state.json``, ``checkpoint-N/``), plus, for
jobs run by ``trainer-ext train``, ``trainer_ext_run.json`` (the job) and ``trainer_ext_events.jsonl`` (starts, resumes,
checkpoints, end). The history is read from whichever of ``trainer_state.json`` and the newest checkpoint's is further
along, so a run that died between checkpoints still reports up to its last save.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from trainer_ext.checkpointing import marker as markers
from trainer_ext.checkpointing.listing import sorted_checkpoints
from trainer_ext.errors import ConfigError
from trainer_ext.report.clean import clean_job, clean_results, clean_state, finite
from trainer_ext.report.events import EVENTS_FILE, process_alive, read_events, seconds_since
from trainer_ext.report.reading import (
    STATE_MAX_BYTES,
    Unreadable,
    is_dir,
    optional_object,
    parse_json,
    read_bytes,
    read_json,
)

STATE_FILE = "trainer_state.json"
JOB_FILE = "trainer_ext_run.json"
# another host's run counts as still training while its last event is younger than this
QUIET_SECONDS = 15 * 60
# how far ahead of this host's clock another host's may run; an event further in the future is no sign of life
CLOCK_SKEW = 5 * 60
TOKEN_KEYS = ("num_input_tokens_seen", "tokens_seen")
# eval_* values that describe speed, not the model
EVAL_SPEED = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_samples")


@dataclass
class Checkpoint:
    step: int
    path: Path | None  # None: saved, then rotated away (known from the events only)
    complete: bool
    marker: dict[str, Any] = field(default_factory=dict)
    time: float | None = None


@dataclass
class Segment:
    """One process's stretch of training: from a start (fresh or resumed) to its end or its last sign of life."""

    start_step: int
    start_time: float
    resumed: bool
    last_step: int
    last_time: float
    status: str  # finished | stopped | interrupted | running
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return max(self.last_time - self.start_time, 0.0)


@dataclass
class Resume:
    step: int  # the checkpoint step training went on from
    time: float
    after: str  # what the previous segment did: interrupted | finished | stopped
    redone_steps: int  # steps the previous segment had logged past the checkpoint, trained again


@dataclass
class RunData:
    path: Path
    label: str
    state: dict[str, Any]
    state_file: Path
    job: dict[str, Any] | None
    events: list[dict[str, Any]]
    results: dict[str, Any]
    checkpoints: list[Checkpoint]
    segments: list[Segment]
    status: str  # finished | stopped | interrupted | running | unknown
    notes: list[str] = field(default_factory=list)  # what was skipped or left out, one line each

    # -- the series ---------------------------------------------------------------------------------------
    @property
    def history(self) -> list[dict[str, Any]]:
        return self.state.get("log_history") or []

    @cached_property
    def train_logs(self) -> list[dict[str, Any]]:
        """Training log lines (those with ``loss``), one per step, in step order."""
        return _by_step(e for e in self.history if "loss" in e and "step" in e)

    @cached_property
    def eval_logs(self) -> list[dict[str, Any]]:
        """Evaluation results, one per step. train() evaluates again after the final step (with
        --load_best_model_at_end, the best checkpoint's model): there the evaluation made in training counts."""
        return _by_step((e for e in self.history if "step" in e and any(k.startswith("eval_") for k in e)), first=True)

    def series(self, key: str, logs: list[dict[str, Any]] | None = None) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` where it is logged and finite."""
        logs = self.train_logs if logs is None else logs
        points = [(e["step"], float(e[key])) for e in logs if _finite(e.get(key))]
        return [s for s, _ in points], [v for _, v in points]

    def eval_series(self, key: str) -> tuple[list[int], list[float]]:
        return self.series(key, self.eval_logs)

    def eval_metric_names(self) -> list[str]:
        names: dict[str, None] = {}
        for entry in self.eval_logs:
            for key, value in entry.items():
                if key.startswith("eval_") and key not in EVAL_SPEED and _finite(value):
                    names[key] = None
        return list(names)

    @cached_property
    def token_key(self) -> str | None:
        """The log key counting tokens seen, when the run logged one."""
        return next((k for k in TOKEN_KEYS if any(_finite(e.get(k)) and e[k] > 0 for e in self.history)), None)

    def tokens_at(self, steps: list[int]) -> list[float] | None:
        """Tokens seen at ``steps`` (interpolated between logged counts), or None when the run did not count them."""
        if self._token_counts is None:
            return None
        xs, ys = self._token_counts
        return [_interp(step, xs, ys) for step in steps]

    @cached_property
    def _token_counts(self) -> tuple[list[float], list[float]] | None:
        """(steps, tokens seen) where the run logged its count, from (0, 0); None when it did not count them."""
        key = self.token_key
        if key is None:
            return None
        known = sorted({e["step"]: float(e[key]) for e in self.history if "step" in e and _finite(e.get(key))}.items())
        return [0] + [s for s, _ in known], [0.0] + [t for _, t in known]

    def skip_events(self, key: str) -> list[tuple[int, int]]:
        """(step, how many) where a cumulative counter (``skipped_optimizer_steps``, ``nan_guard_skipped_steps``)
        grew; a counter that restarts (a resumed process counts from 0) is followed across the restart."""
        out, previous = [], 0
        for step, value in zip(*self.series(key), strict=False):
            value = int(value)
            grown = value - previous if value >= previous else value
            if grown > 0:
                out.append((step, grown))
            previous = value
        return out

    @property
    def resumes(self) -> list[Resume]:
        out = []
        for before, segment in zip(self.segments, self.segments[1:], strict=False):
            if segment.resumed:
                redone = max(before.last_step - segment.start_step, 0)
                out.append(Resume(segment.start_step, segment.start_time, before.status, redone))
        return out

    @property
    def global_step(self) -> int:
        return int(self.state.get("global_step") or 0)

    @property
    def wall_seconds(self) -> float | None:
        """Time spent in all segments (gaps between them left out); from train_runtime when there are no events."""
        if self.segments:
            return sum(s.seconds for s in self.segments)
        runtime = self.results.get("train_runtime")
        if not _finite(runtime):
            runtime = next(
                (e["train_runtime"] for e in reversed(self.history) if _finite(e.get("train_runtime"))), None
            )
        return float(runtime) if runtime is not None else None

    def first_start(self) -> dict[str, Any]:
        return next((e for e in self.events if e["event"] == "start"), {})

    def last_start(self) -> dict[str, Any]:
        return next((e for e in reversed(self.events) if e["event"] == "start"), {})


_finite = finite  # the name summary.py imports


def _by_step(entries: Any, first: bool = False) -> list[dict[str, Any]]:
    """One entry per step, in step order: the last logged, or with ``first`` the first (later ones fill its gaps)."""
    out: dict[int, dict[str, Any]] = {}
    for entry in entries:
        step = int(entry["step"])
        out[step] = {**entry, **out[step]} if first and step in out else entry
    return [out[s] for s in sorted(out)]


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x >= xs[-1]:
        return (
            ys[-1]
            if len(xs) < 2 or xs[-1] == xs[-2]
            else ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        )
    i = max(bisect_left(xs, x), 1)  # xs ascend: the first index with x <= xs[i]
    span = xs[i] - xs[i - 1]
    return ys[i] if span == 0 else ys[i - 1] + (x - xs[i - 1]) * (ys[i] - ys[i - 1]) / span


def _read_json(path: Path) -> Any:
    """The run's trainer state: needed, so a file that cannot be read safely is a ConfigError (one line)."""
    try:
        data = read_bytes(path, STATE_MAX_BYTES)
        if data is None:
            raise ConfigError(f"cannot read {path}: no such file")
        if not data.strip():
            raise ConfigError(f"{path} is empty: the run has logged nothing yet (or the file was cut short)")
        return parse_json(data, path)
    except Unreadable as why:
        raise ConfigError(f"{why}: the report needs it") from why


def _marker_of(folder: Path) -> dict[str, Any] | None:
    """The checkpoint's marker when it is valid and the files it lists are all there at their sizes, else None.

    Sizes only (a stat per file): the checksums are for resume's :func:`~trainer_ext.checkpointing.verification.verify`,
    too slow for a report written at every checkpoint.
    """
    try:
        body = markers.read_marker(folder)
    except (markers.CheckpointError, OSError):
        return None
    if body is None:
        return None
    for name, size in body["files"].items():
        path = folder / name
        try:
            if not path.is_file() or path.stat().st_size != size:
                return None
        except (OSError, ValueError):
            return None
    return body


def list_checkpoints(run_dir: Path, events: list[dict[str, Any]]) -> list[Checkpoint]:
    """The checkpoint-N folders (complete or not) and those the events say were saved and later rotated away.

    Complete as resume judges it (:mod:`trainer_ext.checkpointing.marker`): a valid marker whose files are there; a
    folder without one counts only in a plain transformers run (no checkpoint of the run has a marker) that holds
    its trainer_state.json. A damaged marker, or a save that died (``.trainer_ext_saving`` left), is not complete.
    """
    found: dict[int, Checkpoint] = {}
    folders = sorted_checkpoints(run_dir)
    ours = any(markers.has_marker(folder) for folder in folders)
    for folder in folders:
        step = int(folder.name.rsplit("-", 1)[1])
        body = _marker_of(folder)
        if body is not None:
            found[step] = Checkpoint(step, folder, True, body)
            continue
        plain = not ours and not (folder / markers.SAVING).exists() and (folder / STATE_FILE).is_file()
        found[step] = Checkpoint(step, folder, plain)
    for event in events:
        if event["event"] == "save" and isinstance(event.get("step"), int):
            step = event["step"]
            if step in found:
                found[step].time = event.get("time")
            else:
                found[step] = Checkpoint(step, None, True, time=event.get("time"))
    return [found[s] for s in sorted(found)]


def _pick_state(run_dir: Path, checkpoints: list[Checkpoint], notes: list[str]) -> Path | None:
    """The trainer_state.json that reaches furthest: the run's own or its newest checkpoint's (top-level on a tie).

    One that cannot be read safely is passed over (said in ``notes``) while another can; else it is returned, and
    reading it says why it cannot be used.
    """
    candidates = [run_dir / STATE_FILE] + [
        c.path / STATE_FILE for c in reversed(checkpoints) if c.path is not None and c.complete
    ][:1]
    present = [path for path in candidates if path.exists() or path.is_symlink()]
    best, best_step, passed = None, -1, []
    for path in present:
        try:
            value = read_json(path, STATE_MAX_BYTES)
        except Unreadable as why:
            passed.append(str(why))
            continue
        step = value.get("global_step", 0) if isinstance(value, dict) else -1
        if isinstance(step, int) and step > best_step:
            best, best_step = path, step
    if best is not None:
        notes += [f"{why}: not read, the report is drawn from {best}" for why in passed]
    return best or (present[0] if present else None)


def segments_of(events: list[dict[str, Any]], *, this_one_trains: bool = False) -> list[Segment]:
    """Split the events at each start; each segment ends at its 'end' event or its last event (interrupted).

    ``this_one_trains``: the caller is the training process (a report at a checkpoint): its own segment is running.
    """
    segments: list[Segment] = []
    current: Segment | None = None
    for event in events:
        kind, when = event["event"], float(event["time"])
        step = event.get("step") if isinstance(event.get("step"), int) else None
        if kind == "start":
            if current is not None:
                segments.append(current)
            start_step = step or 0
            current = Segment(start_step, when, bool(event.get("resumed")), start_step, when, "interrupted", event)
            continue
        if current is None:
            continue
        current.last_time = max(current.last_time, when)
        if step is not None:
            current.last_step = max(current.last_step, step)
        if kind == "end":
            status = event.get("status", "finished")
            current.status = status if status in ("finished", "stopped") else "finished"
    if current is not None:
        segments.append(current)
    if segments and segments[-1].status == "interrupted" and _still_running(segments[-1], events, this_one_trains):
        segments[-1].status = "running"
    return segments


def _still_running(segment: Segment, events: list[dict[str, Any]], this_one_trains: bool) -> bool:
    alive = process_alive(segment.info, this_one_trains=this_one_trains)
    if alive is None:  # another host: judge by the last sign of life, when its clock reading is believable
        return -CLOCK_SKEW <= seconds_since(events[-1]) < QUIET_SECONDS
    return alive


def load_run(
    path: str | Path, *, allow_running: bool = False, label: str | None = None, this_one_trains: bool = False
) -> RunData:
    """Read one run folder; ConfigError (one line) when it is not a run, has logged nothing, or is still training.

    ``this_one_trains``: called from the training process itself (the report at a checkpoint), which is running.
    """
    run_dir = Path(path)
    kind = is_dir(run_dir, "run folder")
    if kind is None:
        raise ConfigError(f"{str(path)!r}: no such folder. Pass the --output_dir of a training run")
    if not kind:
        raise ConfigError(f"{str(path)!r} is a file, not a run folder. Pass the --output_dir of a training run")
    notes: list[str] = []
    events = read_events(run_dir, notes)
    checkpoints = list_checkpoints(run_dir, events)
    segments = segments_of(events, this_one_trains=this_one_trains)
    if segments and segments[-1].status == "running" and not allow_running:
        start = segments[-1].info
        raise ConfigError(
            f"{str(path)!r} is still training (pid {start.get('pid')} on {start.get('host')}, at step "
            f"{segments[-1].last_step}); its report is refreshed at each checkpoint in {run_dir / 'report'} and "
            "written in full when it ends (or pass --partial to plot it now)"
        )
    state_file = _pick_state(run_dir, checkpoints, notes)
    if state_file is None:
        if events:
            raise ConfigError(
                f"{str(path)!r} has no {STATE_FILE} yet (no checkpoint saved and the run did not finish): "
                "nothing to plot; its curves appear with its first checkpoint"
            )
        raise ConfigError(
            f"{str(path)!r} is not a training run folder: no {STATE_FILE}, no checkpoint-N/ and no {EVENTS_FILE}. "
            "Pass the --output_dir of a training run"
        )
    state = _read_json(state_file)
    if not isinstance(state, dict):
        raise ConfigError(f"{state_file} is not a trainer state (expected a JSON object)")
    state = clean_state(state, str(state_file), notes)
    if not any("step" in e for e in state["log_history"]):
        raise ConfigError(
            f"{state_file} has an empty log (log_history holds no logged step): nothing to plot. "
            "Log more often (--logging_steps) or train longer"
        )
    job = clean_job(optional_object(run_dir / JOB_FILE, notes).get("job"))
    status = segments[-1].status if segments else ("finished" if (run_dir / STATE_FILE).is_file() else "unknown")
    run = RunData(
        path=run_dir,
        label=label or run_dir.resolve().name,
        state=state,
        state_file=state_file,
        job=job,
        events=events,
        results=clean_results(optional_object(run_dir / "all_results.json", notes)),
        checkpoints=checkpoints,
        segments=segments,
        status=status,
        notes=notes,
    )
    return run


def load_runs(paths: list[str | Path], *, allow_running: bool = False, this_one_trains: bool = False) -> list[RunData]:
    """Read several run folders, labelled by folder name (with the parent's name added where two names clash)."""
    runs = [load_run(p, allow_running=allow_running, this_one_trains=this_one_trains) for p in paths]
    names = [r.label for r in runs]
    for run in runs:
        if names.count(run.label) > 1:
            run.label = f"{run.path.resolve().parent.name}/{run.label}"
    labels = [r.label for r in runs]
    for i, run in enumerate(runs):
        if labels.count(run.label) > 1:
            run.label = f"{run.label} #{i + 1}"
    return runs
