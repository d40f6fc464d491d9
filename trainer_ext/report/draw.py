"""All the report's figures, in page order (the figures of :mod:`.figures` and the timeline of :mod:`.timeline`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from trainer_ext.report.figures import (
    Figure,
    eval_metrics_figure,
    line_figure,
    loss_figure,
    stability_figure,
    throughput_figure,
)
from trainer_ext.report.run import RunData
from trainer_ext.report.timeline import timeline_figure


def draw_all(runs: list[RunData], out: Path, smoothing: float, notes: list[str] | None = None) -> list[Figure]:
    """Every figure that has data, in page order, each saved under its temporary name (see :func:`~trainer_ext.report.figures._save`); when one
    fails, those already saved are removed. ``notes`` gets a line for each thing left out of them."""
    lr_caption = "The learning rate at each logged step (the schedule counts optimizer steps)."
    norm_caption = "The total gradient norm before clipping (log scale when it spans more than 50×)."
    draws: list[Callable[[], Figure | None]] = [
        lambda: loss_figure(runs, out, smoothing),
        lambda: loss_figure(runs, out, smoothing, by_tokens=True),
        lambda: line_figure(runs, out, "learning_rate", "learning_rate", "Learning rate", "learning rate", lr_caption),
        lambda: line_figure(
            runs, out, "grad_norm", "grad_norm", "Gradient norm", "gradient norm", norm_caption, log=True
        ),
        lambda: throughput_figure(runs, out),
        lambda: eval_metrics_figure(runs, out, notes),
        lambda: stability_figure(runs, out),
        lambda: timeline_figure(runs, out, notes),
    ]
    figures: list[Figure] = []
    try:
        with warnings.catch_warnings():  # a name in a script the font lacks is drawn as boxes: no warning each time
            warnings.filterwarnings("ignore", message="Glyph .* missing from", category=UserWarning)
            for draw in draws:
                figure = draw()
                if figure is not None:
                    figures.append(figure)
    except BaseException:
        for figure in figures:
            if figure.path is not None:
                figure.path.unlink(missing_ok=True)
        raise
    return figures
