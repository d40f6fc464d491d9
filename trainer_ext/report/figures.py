"""The report's figures, drawn with matplotlib's Agg canvas (no display, no pyplot state): one function per figure.

Each takes the runs (several overlay, one colour each) and returns a :class:`Figure` to save, or None when no run
logged what it shows. Checkpoints (dotted), resumes (dashed, labelled) and skipped steps (ticks at the bottom) are
marked on every step axis; step axes start at 0, end at the last step and have whole-number ticks. A series of one
point is drawn as a marker (a line through one point draws nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer_ext.report.bounds import MAX_MARKS, MAX_PANELS, MAX_POINTS, left_out, literal, spread, thin
from trainer_ext.report.run import RunData

DPI = 100
WIDE = (9.0, 4.2)
FIGURE_NAMES = (
    "loss_vs_step",
    "loss_vs_tokens",
    "learning_rate",
    "grad_norm",
    "throughput",
    "eval_metrics",
    "skipped_steps",
    "timeline",
)
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
# eval_* values not drawn as metrics: transformers' mean of batch means (a variant of eval_loss, drawn with the loss)
NOT_DRAWN = ("eval_batch_mean_loss",)


@dataclass
class Figure:
    name: str  # file stem
    title: str
    caption: str
    path: Path | None = None


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's debiased exponential moving average (``weight`` 0: raw; 0.99: very smooth)."""
    out, last, norm = [], 0.0, 0.0
    for value in values:
        last = last * weight + (1 - weight) * value
        norm = norm * weight + (1 - weight)
        out.append(last / norm if norm else value)
    return out


def _new(rows: int = 1, height: float | None = None, x_end: float | None = None) -> tuple[Any, Any]:
    """A figure of ``rows`` panels sharing x; ``x_end``: the x axis counts steps (or tokens) from 0 to ``x_end``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(WIDE[0], height or WIDE[1] * (1 if rows == 1 else 0.62 * rows)), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    if x_end is not None:
        whole_ticks(axes[-1].xaxis)
        pad = max(0.5, x_end * 0.02)  # room for a marker at either end
        axes[-1].set_xlim(-pad, max(x_end, 1) + pad)
    return fig, axes


def whole_ticks(axis: Any) -> None:
    """Ticks at whole numbers only (a 5-step run is not labelled 2.5)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def points(count: int, many: int = 60) -> dict[str, Any]:
    """Marker style for a series of ``count`` points: a dot on each when few, a visible disc for a single one."""
    if count == 1:
        return {"marker": "o", "markersize": 6}
    return {"marker": "."} if count < many else {}


def last_step(runs: list[RunData]) -> int:
    """Where the step axis ends: the furthest step any run reached or logged."""
    logged = [e["step"] for r in runs for e in r.history if "step" in e]
    return max([r.global_step for r in runs] + logged + [c.step for r in runs for c in r.checkpoints])


def _save(fig: Any, out: Path, figure: Figure) -> Figure:
    """Save under a temporary name (``.NAME.png.tmp``, its ``path``): :func:`~trainer_ext.report.build.write_report`
    renames it when the whole report is written, and removes it when a write fails (a full disk)."""
    fig.tight_layout()
    tmp = out / f".{figure.name}.png.tmp"
    try:
        fig.savefig(tmp, format="png", dpi=DPI, facecolor="white")  # rcParams are the caller's: not changed
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    figure.path = tmp
    return figure


def plot(ax: Any, xs: list[float], ys: list[float], *args: Any, **kwargs: Any) -> None:
    """``ax.plot`` of a line thinned to MAX_POINTS points (its label taken literally)."""
    if kwargs.get("label") is not None:
        kwargs["label"] = literal(kwargs["label"])
    ax.plot(*thin(xs, ys), *args, **kwargs)


def colour(index: int) -> str:
    return COLOURS[index % len(COLOURS)]


def mark_events(ax: Any, run: RunData, col: str, x_of: Callable[[list[int]], list[float] | None], label: bool) -> None:
    """Checkpoints, resumes and skipped steps of ``run`` on a step (or tokens) axis."""
    from matplotlib.transforms import blended_transform_factory

    bottom = blended_transform_factory(ax.transData, ax.transAxes)
    saved = spread([c.step for c in run.checkpoints], MAX_MARKS)
    for i, x in enumerate(x_of(saved) or []):
        ax.axvline(
            x, color=col, linestyle=":", linewidth=0.9, alpha=0.55, label="checkpoint" if label and i == 0 else None
        )
    for i, resume in enumerate(spread(run.resumes, MAX_MARKS)):
        xs = x_of([resume.step]) or []
        for x in xs:
            ax.axvline(x, color=col, linestyle="--", linewidth=1.8, label="resume" if label and i == 0 else None)
            ax.text(
                x, 0.98, f" resumed at {resume.step}", transform=bottom, color=col, fontsize=8, va="top", rotation=90
            )
    for key, marker, name in (
        ("skipped_optimizer_steps", "x", "fp16 skipped step"),
        ("nan_guard_skipped_steps", "v", "NaN-guard skip"),
    ):
        events = spread(run.skip_events(key), MAX_POINTS)
        xs = x_of([s for s, _ in events]) or []
        if xs:
            ax.scatter(
                xs,
                [0.02] * len(xs),
                transform=bottom,
                marker=marker,
                color=col,
                s=30,
                zorder=5,
                label=name if label else None,
            )


def _steps(steps: list[int]) -> list[float]:
    return [float(s) for s in steps]


def _label(run: RunData, runs: list[RunData]) -> str | None:
    return run.label if len(runs) > 1 else None  # taken literally by plot()


def _legend(ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        unique = dict(zip(labels, handles, strict=False))
        ax.legend(unique.values(), unique.keys(), fontsize=8, loc="best")


def loss_figure(runs: list[RunData], out: Path, smoothing: float, by_tokens: bool = False) -> Figure | None:
    axis = (lambda run: run.tokens_at) if by_tokens else (lambda run: _steps)
    if by_tokens and not any(r.token_key for r in runs):
        return None
    if not any(r.series("loss")[0] or r.eval_series("eval_loss")[0] for r in runs):
        return None
    end = last_step(runs)
    if by_tokens:
        end = max((r.tokens_at([end]) or [0.0])[0] for r in runs)
    fig, (ax,) = _new(x_end=end)
    for i, run in enumerate(runs):
        col, x_of, prefix = colour(i), axis(run), f"{run.label}: " if len(runs) > 1 else ""
        if x_of is None or (by_tokens and run.token_key is None):
            continue
        steps, losses = run.series("loss")
        if len(losses) == 1:  # raw and smoothed are the same point; a diamond, told apart from eval's discs
            plot(
                ax,
                x_of(steps),
                losses,
                color=col,
                linestyle="none",
                marker="D",
                markersize=6,
                label=f"{prefix}train loss",
            )
        elif losses:
            xs = x_of(steps)
            plot(ax, xs, losses, color=col, alpha=0.3, linewidth=1, label=f"{prefix}train loss (raw)")
            plot(
                ax,
                xs,
                smooth(losses, smoothing),
                color=col,
                linewidth=2,
                label=f"{prefix}train loss (smoothed {smoothing:g})",
            )
        steps, losses = run.eval_series("eval_loss")
        if losses:
            plot(
                ax,
                x_of(steps),
                losses,
                color=col,
                linestyle="--",
                marker="o",
                markersize=5,
                label=f"{prefix}eval loss",
            )
        mark_events(ax, run, col, x_of, label=i == 0)
    ax.set_xlabel("tokens seen" if by_tokens else "optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("Loss vs tokens seen" if by_tokens else "Loss vs step")
    _legend(ax)
    name, title = ("loss_vs_tokens", "Loss vs tokens seen") if by_tokens else ("loss_vs_step", "Loss vs step")
    caption = (
        "Training loss as logged (faint) and smoothed (solid; a diamond when logged once), evaluation loss (dashed, "
        "dots); dotted lines are checkpoints, dashed lines resumes, ticks at the bottom skipped optimizer steps."
    )
    if by_tokens:
        caption += " Tokens are the positions the model processed, padding included."
    return _save(fig, out, Figure(name, title, caption))


def line_figure(
    runs: list[RunData], out: Path, key: str, name: str, title: str, ylabel: str, caption: str, log: bool = False
) -> Figure | None:
    if not any(r.series(key)[0] for r in runs):
        return None
    fig, (ax,) = _new(x_end=last_step(runs))
    for i, run in enumerate(runs):
        steps, values = run.series(key)
        if values:
            plot(ax, steps, values, color=colour(i), linewidth=1.6, **points(len(steps)), label=_label(run, runs))
        mark_events(ax, run, colour(i), _steps, label=i == 0)
    values = [v for r in runs for v in r.series(key)[1]]
    if log and values and min(values) > 0 and max(values) / min(values) > 50:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _legend(ax)
    return _save(fig, out, Figure(name, title, caption))


def throughput_figure(runs: list[RunData], out: Path) -> Figure | None:
    keys = [k for k in ("samples_per_second", "tokens_per_second", "mfu") if any(r.series(k)[0] for r in runs)]
    if not keys:
        return None
    fig, axes = _new(len(keys), x_end=last_step(runs))
    labels = {"samples_per_second": "samples / s", "tokens_per_second": "tokens / s", "mfu": "MFU"}
    for ax, key in zip(axes, keys, strict=False):
        for i, run in enumerate(runs):
            steps, values = run.series(key)
            if values:
                plot(ax, steps, values, color=colour(i), linewidth=1.4, **points(len(steps)), label=_label(run, runs))
            mark_events(ax, run, colour(i), _steps, label=False)
        ax.set_ylabel(labels[key])
        ax.set_ylim(bottom=0)
    axes[0].set_title("Throughput (training time only, over all processes)")
    axes[-1].set_xlabel("optimizer step")
    _legend(axes[0])
    caption = (
        "Samples and tokens per second of training time in each logging window (evaluation and saving excluded), "
        "summed over processes; MFU where the device's peak is known (none on CPU)."
    )
    return _save(fig, out, Figure("throughput", "Throughput", caption))


def eval_metrics_figure(runs: list[RunData], out: Path, notes: list[str] | None = None) -> Figure | None:
    """A panel per eval metric (eval_loss is on the loss figure) that some run evaluated at two steps or more.

    A metric evaluated once is a number, not a curve: the summary's final metrics hold it. At most MAX_PANELS
    panels (the first metrics logged); ``notes`` says how many were left out.
    """
    names = list(dict.fromkeys(n for r in runs for n in r.eval_metric_names() if n not in ("eval_loss", *NOT_DRAWN)))
    names = [n for n in names if any(len(r.eval_series(n)[0]) > 1 for r in runs)]
    if not names:
        return None
    if len(names) > MAX_PANELS and notes is not None:
        notes.append(left_out("eval metrics drawn", MAX_PANELS, len(names)) + " (the first logged)")
    names = names[:MAX_PANELS]
    fig, axes = _new(len(names), height=min(2.4 * len(names) + 0.8, 14), x_end=last_step(runs))
    for ax, name in zip(axes, names, strict=False):
        for i, run in enumerate(runs):
            steps, values = run.eval_series(name)
            if values:
                plot(
                    ax,
                    steps,
                    values,
                    color=colour(i),
                    marker="o",
                    markersize=5,
                    linewidth=1.4,
                    label=_label(run, runs),
                )
        ax.set_ylabel(literal(name.removeprefix("eval_")), fontsize=9)
    axes[0].set_title("Evaluation metrics")
    axes[-1].set_xlabel("optimizer step")
    _legend(axes[0])
    caption = (
        "Each eval_* value the run logged at two evaluations or more, by step (eval_loss is on the loss figure; a "
        "value evaluated once is in the summary's final metrics)."
    )
    return _save(fig, out, Figure("eval_metrics", "Evaluation metrics", caption))


def stability_figure(runs: list[RunData], out: Path) -> Figure | None:
    """Cumulative skipped steps; None unless some run skipped one (a flat zero line shows nothing)."""
    keys = ("skipped_optimizer_steps", "nan_guard_skipped_steps")
    if not any(r.skip_events(key) for r in runs for key in keys):
        return None
    fig, (ax,) = _new(x_end=last_step(runs))
    whole_ticks(ax.yaxis)
    for i, run in enumerate(runs):
        for key, style, name in (
            ("skipped_optimizer_steps", "-", "fp16 loss-scaler skips"),
            ("nan_guard_skipped_steps", ":", "NaN-guard skips"),
        ):
            events = run.skip_events(key)
            if not events and not run.series(key)[0]:
                continue
            steps, total = [0], [0]
            for step, count in events:
                steps += [step, step]
                total += [total[-1], total[-1] + count]
            steps.append(max(run.global_step, steps[-1]))
            total.append(total[-1])
            prefix = f"{run.label}: " if len(runs) > 1 else ""
            plot(ax, steps, total, color=colour(i), linestyle=style, linewidth=1.8, label=f"{prefix}{name}")
        mark_events(ax, run, colour(i), _steps, label=i == 0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("steps skipped (cumulative)")
    ax.set_title("Skipped optimizer steps: fp16 overflow and NaN guard")
    _legend(ax)
    caption = (
        "Cumulative optimizer steps the fp16 loss scaler skipped (gradient overflow) and steps NaNGuardCallback "
        "dropped (non-finite loss or gradient)."
    )
    return _save(fig, out, Figure("skipped_steps", "Skipped steps and NaN-guard events", caption))
