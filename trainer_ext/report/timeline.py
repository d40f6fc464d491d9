"""The timeline figure: optimizer step against wall-clock time, one line per session (the newest MAX_SESSIONS)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer_ext.report import figures
from trainer_ext.report.bounds import MAX_POINTS, MAX_SESSIONS, left_out, literal, thin
from trainer_ext.report.figures import Figure, _legend, _new, colour, points, whole_ticks
from trainer_ext.report.run import RunData


def _session_points(run: RunData) -> list[list[tuple[float, int]]]:
    """(time, step) of each session's start, logs, checkpoints and end: the events after its start event (each
    start begins the next session, as :func:`~trainer_ext.report.run.segments_of` splits them) within its times."""
    out: list[list[tuple[float, int]]] = [[(s.start_time, s.start_step)] for s in run.segments]
    index = -1
    for event in run.events:
        if event["event"] == "start":
            index += 1
            continue
        if index < 0 or index >= len(out) or event["event"] not in ("log", "save", "end"):
            continue
        segment = run.segments[index]
        if isinstance(event.get("step"), int) and segment.start_time <= event["time"] <= segment.last_time + 1e-6:
            out[index].append((event["time"], event["step"]))
    return out


def _draw_run(ax: Any, run: RunData, i: int, several: bool, scale: float, notes: list[str] | None) -> None:
    origin, col = run.segments[0].start_time, colour(i)
    saves = [(e["time"], e["step"]) for e in run.events if e["event"] == "save" and isinstance(e.get("step"), int)]
    if saves:
        xs, ys = thin([(t - origin) / scale for t, _ in saves], [s for _, s in saves])
        ax.plot(xs, ys, marker="s", color=col, markersize=5, linestyle="none", label="checkpoint" if i == 0 else None)
    sessions = list(zip(run.segments, _session_points(run), strict=False))
    if len(sessions) > MAX_SESSIONS:
        if notes is not None:
            notes.append(left_out(f"{run.label}: sessions drawn on the timeline", MAX_SESSIONS, len(sessions)))
        sessions = sessions[-MAX_SESSIONS:]
    most = max(2, MAX_POINTS // len(sessions))
    for k, (segment, pts) in enumerate(sessions):
        xs, ys = thin([(t - origin) / scale for t, _ in pts], [s for _, s in pts], most)
        ax.plot(
            xs,
            ys,
            color=col,
            linewidth=1.8,
            **(points(1) if len(pts) == 1 else {}),
            label=(literal(run.label) if several and k == 0 else None),
        )
        if segment.resumed:
            ax.axvline(xs[0], color=col, linestyle="--", linewidth=1.5, label="resume" if i == 0 and k == 1 else None)
        if segment.status in ("interrupted", "stopped", "running"):
            ax.plot(
                [xs[-1]],
                [ys[-1]],
                marker="X",
                color=col,
                markersize=9,
                linestyle="none",
                label=f"{segment.status}" if i == 0 else None,
            )


def timeline_figure(runs: list[RunData], out: Path, notes: list[str] | None = None) -> Figure | None:
    """Step against wall-clock time, one line per session: gaps are downtime, dashed lines resumes."""
    if not any(r.segments for r in runs):
        return None
    span = max(s.last_time - r.segments[0].start_time for r in runs if r.segments for s in r.segments)
    unit, scale = ("seconds", 1) if span < 180 else ("minutes", 60) if span < 3 * 3600 else ("hours", 3600)
    fig, (ax,) = _new()
    whole_ticks(ax.yaxis)
    for i, run in enumerate(runs):
        if run.segments:
            _draw_run(ax, run, i, len(runs) > 1, scale, notes)
    ax.set_xlabel(f"wall-clock {unit} since the first start")
    ax.set_ylabel("optimizer step")
    ax.set_title("Progress over time: sessions, checkpoints, resumes")
    _legend(ax)
    caption = (
        "Each training session (process start to end or interruption) is a line; squares are checkpoints, "
        "crosses interruptions, dashed lines resumes. Steps trained again after a resume show as a drop."
    )
    return figures._save(fig, out, Figure("timeline", "Progress over wall-clock time", caption))
