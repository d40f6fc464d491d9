"""``write_report``: run folders in, PNG figures and one self-contained ``report.html`` out."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from trainer_ext.errors import ConfigError
from trainer_ext.report.reading import is_dir
from trainer_ext.report.run import load_runs

logger = logging.getLogger(__name__)

PAGE = "report.html"
INSTALL = "pip install 'matplotlib>=3.7'"
COMPARE_DIR = "trainer_ext_report"
DEFAULT_SMOOTHING = 0.6


def matplotlib_missing() -> str | None:
    """None when matplotlib imports, else the one-line message saying how to install it."""
    try:
        import matplotlib  # noqa: F401  (the figures draw on FigureCanvasAgg directly: no backend is selected)
    except ImportError:
        return f"the report's figures need matplotlib, which is not installed: {INSTALL}"
    return None


def default_out(run_dirs: list[str | os.PathLike]) -> Path:
    """One run: RUN/report; several: ./trainer_ext_report."""
    return Path(run_dirs[0]) / "report" if len(run_dirs) == 1 else Path(COMPARE_DIR)


def write_report(
    run_dirs: list[str | os.PathLike],
    out_dir: str | os.PathLike | None = None,
    *,
    allow_running: bool = False,
    smoothing: float = DEFAULT_SMOOTHING,
    require_figures: bool = True,
    this_one_trains: bool = False,
    written_by: str = "trainer-ext report",
    notes: list[str] | None = None,
) -> Path:
    """Write the figures and ``report.html`` for ``run_dirs`` into ``out_dir``; return the page's path.

    ConfigError on bad input (not a run, an empty log, a run still training unless ``allow_running``) and, with
    ``require_figures``, when matplotlib is missing; without it the page then holds the tables only. A folder that
    cannot be written (permissions, a full disk) is a ConfigError too. ``this_one_trains``: called by the training
    process itself (its report at a checkpoint), whose run is in progress. matplotlib's backend and rcParams are
    left as they were. ``written_by``: who wrote the page, said in its header. ``notes``: gets one line for each
    thing skipped (an unreadable file, malformed entries) or bounded (see :mod:`.bounds`), as the page lists them.
    The figures and the page are written under temporary names and renamed at the end: a failed write (a full
    disk) leaves the folder as it was.
    """
    if not run_dirs:
        raise ConfigError("no run folder given")
    if not 0 <= smoothing < 1:
        raise ConfigError(f"--smoothing must be in [0, 1), got {smoothing}")
    missing = matplotlib_missing()
    if missing and require_figures:
        raise ConfigError(missing)
    runs = load_runs(list(run_dirs), allow_running=allow_running, this_one_trains=this_one_trains)
    out = Path(out_dir) if out_dir is not None else default_out(list(run_dirs))
    if is_dir(out, "--out") is False:
        raise ConfigError(f"--out {str(out)!r} is a file; pass a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create --out {str(out)!r}: {error.strerror or error}") from error
    from trainer_ext.report.draw import draw_all
    from trainer_ext.report.figures import FIGURE_NAMES, Figure
    from trainer_ext.report.page import render

    note = f"No figures: {missing}." if missing else None
    if any(run.status == "running" for run in runs):
        note = ((note + " ") if note else "") + "The run is still training: this is a partial report."
    page = out / PAGE
    left_out = [f"{run.label}: {line}" if len(runs) > 1 else line for run in runs for line in run.notes]
    figures: list[Figure] = []
    tmp = out / f".{PAGE}.tmp"
    try:
        if not missing:
            figures = draw_all(runs, out, smoothing, left_out)
        tmp.write_text(render(runs, figures, note, written_by, left_out), encoding="utf-8")
        for figure in figures:  # each drawn under a temporary name: now the report is complete, they take their places
            final = out / f"{figure.name}.png"
            os.replace(figure.path, final)
            figure.path = final
        for stale in set(FIGURE_NAMES) - {f.name for f in figures}:  # from an earlier report into the same folder
            (out / f"{stale}.png").unlink(missing_ok=True)
        os.replace(tmp, page)  # a reader never sees half a page
    except OSError as error:
        raise ConfigError(f"cannot write the report into --out {str(out)!r}: {error.strerror or error}") from error
    finally:
        for leftover in [tmp, *(f.path for f in figures if f.path is not None)]:
            if leftover.name.endswith(".tmp"):
                leftover.unlink(missing_ok=True)
    if notes is not None:
        notes.extend(left_out)
    return page
