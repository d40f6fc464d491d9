"""The report page: one HTML file, figures embedded as base64 PNGs, no script, no link out; opens from disk."""

from __future__ import annotations

import base64
import datetime
import html
from pathlib import Path
from typing import TypeVar

from trainer_ext.report.bounds import MAX_ROWS
from trainer_ext.report.bounds import left_out as left_out_note
from trainer_ext.report.figures import Figure
from trainer_ext.report.run import RunData
from trainer_ext.report.summary import duration, summary_rows

T = TypeVar("T")

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1000px;
       color: #1a1a1a; background: #ffffff; padding: 0 16px; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
.meta { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; width: 100%; font-size: 0.9em; margin: 8px 0; }
th, td { border: 1px solid #d0d7de; padding: 5px 8px; text-align: left; vertical-align: top; }
th { background: #f0f3f6; width: 190px; } td code { word-break: break-all; }
tr.run th { background: #e3ecf7; }
figure { margin: 18px 0; } figure img { width: 100%; border: 1px solid #d0d7de; }
figcaption { color: #444; font-size: 0.88em; margin-top: 4px; }
.warn { background: #fff4e5; border: 1px solid #f0b429; padding: 8px 12px; }
"""


def _e(text: object) -> str:
    return html.escape(str(text))


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def summary_table(runs: list[RunData]) -> str:
    """One column per run (one run: label | value)."""
    rows = [summary_rows(run) for run in runs]
    head = "".join(f"<th>{_e(run.label)}</th>" for run in runs) if len(runs) > 1 else ""
    lines = [f"<tr class='run'><th></th>{head}</tr>"] if head else []
    for index, (label, _) in enumerate(rows[0]):
        cells = "".join(
            f"<td><code>{_e(r[index][1])}</code></td>"
            if label in ("how to resume",)
            else f"<td>{_e(r[index][1])}</td>"
            for r in rows
        )
        lines.append(f"<tr><th>{_e(label)}</th>{cells}</tr>")
    return "<table class='summary'>" + "".join(lines) + "</table>"


def _newest(items: list[T], what: str, run: RunData, notes: list[str] | None) -> list[tuple[int, T]]:
    """The newest MAX_ROWS of ``items``, numbered from 1; ``notes`` says how many were left out."""
    if len(items) > MAX_ROWS and notes is not None:
        notes.append(
            left_out_note(f"{run.label}: {what} listed in the events table (the newest)", MAX_ROWS, len(items))
        )
    return list(enumerate(items, start=1))[-MAX_ROWS:]


def events_table(run: RunData, notes: list[str] | None = None) -> str:
    """Sessions, resumes, checkpoints and skipped steps of one run (the newest MAX_ROWS of each kind)."""
    rows = []
    for number, segment in _newest(run.segments, "sessions", run, notes):
        how = f"resumed from checkpoint-{segment.start_step}" if segment.resumed else "fresh start"
        rows.append(
            f"<tr><td>session {number}</td><td>{_e(_when(segment.start_time))}</td><td>{_e(how)}; steps "
            f"{segment.start_step}–{segment.last_step}; {_e(segment.status)} after {_e(duration(segment.seconds))}"
            f" (pid {_e(segment.info.get('pid'))} on {_e(segment.info.get('host'))})</td></tr>"
        )
    for _, resume in _newest(run.resumes, "resumes", run, notes):
        redone = f"; {resume.redone_steps} steps trained again" if resume.redone_steps else ""
        rows.append(
            f"<tr><td>resume</td><td>{_e(_when(resume.time))}</td><td>at step {resume.step}, after the previous "
            f"session was {_e(resume.after)}{_e(redone)}</td></tr>"
        )
    for _, checkpoint in _newest(run.checkpoints, "checkpoints", run, notes):
        where = checkpoint.path.name if checkpoint.path is not None else "removed by rotation"
        state = "complete" if checkpoint.complete else "INCOMPLETE (no COMPLETE marker: never resumed from)"
        when = _when(checkpoint.time) if checkpoint.time else ""
        rows.append(
            f"<tr><td>checkpoint</td><td>{_e(when)}</td><td>step {checkpoint.step}: {_e(where)}, {_e(state)}</td></tr>"
        )
    for key, name in (
        ("skipped_optimizer_steps", "fp16 skipped steps"),
        ("nan_guard_skipped_steps", "NaN-guard skips"),
    ):
        for _, (step, count) in _newest(run.skip_events(key), name, run, notes):
            rows.append(f"<tr><td>{_e(name)}</td><td></td><td>{count} by step {step}</td></tr>")
    if not rows:
        return "<p class='meta'>No events recorded.</p>"
    return "<table class='events'><tr><th>event</th><th>time</th><th>what</th></tr>" + "".join(rows) + "</table>"


def _image(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def render(
    runs: list[RunData],
    figures: list[Figure],
    note: str | None = None,
    written_by: str = "trainer-ext report",
    left_out: list[str] | None = None,
) -> str:
    """The whole page; ``written_by`` names who wrote it (the report command, or the training job itself);
    ``left_out``: what was skipped or bounded, listed on the page (the events tables add theirs to it)."""
    notes = left_out if left_out is not None else []
    tables = [events_table(run, notes) for run in runs]
    title = "Training report: " + ", ".join(run.label for run in runs)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f"<p class='meta'>written {_e(_when(datetime.datetime.now().timestamp()))} by {_e(written_by)}</p>",
    ]
    if note:
        parts.append(f"<p class='warn'>{_e(note)}</p>")
    if notes:
        items = "".join(f"<li>{_e(line)}</li>" for line in notes)
        parts.append(f"<div class='warn'>Left out of this report:<ul>{items}</ul></div>")
    parts += ["<h2>Summary</h2>", summary_table(runs)]
    for figure in figures:
        parts.append(
            f"<h2>{_e(figure.title)}</h2><figure><img alt='{_e(figure.title)}' src='{_image(figure.path)}'>"
            f"<figcaption>{_e(figure.caption)}</figcaption></figure>"
        )
    for run, table in zip(runs, tables, strict=True):
        parts += [f"<h2>Events{_e(': ' + run.label) if len(runs) > 1 else ''}</h2>", table]
    parts.append("</body></html>")
    return "\n".join(parts)
