"""Reports of short runs: one log line, one evaluation, a handful of steps, two such runs compared.

Checked on what was drawn: the pixels of each one-point series at its place in the PNG, the figures and panels
there are (and are not), the tick positions of the matplotlib axes, the page's header and throughput row.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer_ext.report import figures, load_run, write_report
from trainer_ext.report.callback import ReportCallback
from trainer_ext.report.figures import COLOURS
from trainer_ext.report.summary import summary_rows

from .images import colour_at, figure_boxes, pixels, screenshot, shown_like, visible_tick_labels, visible_ticks

ROOT = Path(__file__).resolve().parents[2]
STEP_AXES = ("loss_vs_step", "learning_rate", "grad_norm", "throughput", "eval_metrics", "skipped_steps")


@pytest.fixture
def drawn(monkeypatch) -> dict:
    """The matplotlib figures the report draws, by name, kept after they are saved."""
    kept, save = {}, figures._save

    def keep(fig, out, figure):
        result = save(fig, out, figure)
        kept[figure.name] = fig
        return result

    monkeypatch.setattr(figures, "_save", keep)
    return kept


def one_log(step: int = 5, loss: float = 2.0, evals: int = 1) -> list[dict]:
    """A run's history: one training log line at ``step`` (with throughput and tokens), ``evals`` evaluations."""
    line = {"step": step, "loss": loss, "learning_rate": 1e-3, "grad_norm": 0.8, "samples_per_second": 90.0}
    history = [{**line, "tokens_per_second": 39720.3, "tokens_seen": 5000}]
    for k in range(evals):
        at = step * (k + 1) // evals
        history.append(
            {"step": at, "eval_loss": loss - 0.2, "eval_accuracy": 0.5 + k / 10, "eval_batch_mean_loss": 1.8}
        )
    return history


def make_run(folder: Path, history: list[dict], **state) -> Path:
    folder.mkdir(parents=True)
    steps = max(e["step"] for e in history)
    body = {"global_step": steps, "max_steps": steps, "log_history": history, **state}
    (folder / "trainer_state.json").write_text(json.dumps(body))
    return folder


def _single_point_lines(fig) -> list[tuple]:
    """(axes, line) for every series of one point in ``fig``."""
    return [(ax, line) for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata()) == 1]


# -- one log line, one evaluation ---------------------------------------------------------------------------------


def test_a_one_log_run_draws_each_series_as_a_visible_point(tmp_path: Path, drawn: dict) -> None:
    page = write_report([make_run(tmp_path / "run", one_log())], tmp_path / "out")
    out = page.parent
    # no eval_metrics (one evaluation is a number: the summary has it), no skipped steps, no timeline (no events)
    assert set(drawn) == {"loss_vs_step", "loss_vs_tokens", "learning_rate", "grad_norm", "throughput"}
    assert {p.stem for p in out.glob("*.png")} == set(drawn)
    loss = drawn["loss_vs_step"].axes[0]
    assert colour_at(out / "loss_vs_step.png", loss, 5, 2.0, COLOURS[0]) >= 20  # the train loss, a diamond
    assert colour_at(out / "loss_vs_step.png", loss, 5, 1.8, COLOURS[0]) >= 20  # the eval loss, a disc
    tokens = drawn["loss_vs_tokens"].axes[0]
    assert colour_at(out / "loss_vs_tokens.png", tokens, 5000, 2.0, COLOURS[0]) >= 20
    for name, fig in drawn.items():
        singles = _single_point_lines(fig)
        assert singles, name
        for ax, line in singles:
            x, y = line.get_xdata()[0], line.get_ydata()[0]
            assert colour_at(out / f"{name}.png", ax, x, y, COLOURS[0]) >= 20, (name, line.get_label(), x, y)
    assert len(drawn["throughput"].axes) == 2  # samples/s and tokens/s; no MFU panel (none logged)
    throughput = dict(summary_rows(load_run(tmp_path / "run")))["throughput"]
    assert throughput == "median 90 samples/s, 39,720 tokens/s (MFU: no known peak for this device)"


def test_steps_are_counted_in_whole_numbers(tmp_path: Path, drawn: dict) -> None:
    write_report([make_run(tmp_path / "run", one_log(step=5))], tmp_path / "out")
    for name in set(STEP_AXES) & set(drawn):
        ax = drawn[name].axes[-1]
        ticks = visible_ticks(ax)
        assert len(ticks) >= 3 and all(t.is_integer() for t in ticks), (name, ticks)
        assert ax.get_xlim()[0] <= 0 and ax.get_xlim()[1] >= 5  # the axis spans the run, from step 0
        labels = visible_tick_labels(ax)
        assert labels and all(re.fullmatch(r"\d+", label) for label in labels), (name, labels)


def test_two_one_log_runs_compared_draw_both_points(tmp_path: Path, drawn: dict) -> None:
    first = make_run(tmp_path / "a", one_log(loss=2.0))
    second = make_run(tmp_path / "b", one_log(loss=1.2))
    page = write_report([first, second], tmp_path / "out")
    loss, png = drawn["loss_vs_step"].axes[0], page.parent / "loss_vs_step.png"
    assert colour_at(png, loss, 5, 2.0, COLOURS[0]) >= 20 and colour_at(png, loss, 5, 1.2, COLOURS[1]) >= 20
    lr = drawn["learning_rate"].axes[0]
    assert colour_at(page.parent / "learning_rate.png", lr, 5, 1e-3, COLOURS[1]) >= 20  # the second, drawn on top
    assert [t.get_text() for t in loss.get_legend().get_texts()] == [
        "a: train loss",
        "a: eval loss",
        "b: train loss",
        "b: eval loss",
    ]


def test_eval_metrics_has_a_panel_per_metric_evaluated_more_than_once(tmp_path: Path, drawn: dict) -> None:
    write_report([make_run(tmp_path / "run", one_log(step=10, evals=2))], tmp_path / "out")
    panels = drawn["eval_metrics"].axes
    assert [ax.get_ylabel() for ax in panels] == [
        "accuracy"
    ]  # not eval_loss (on the loss figure), not batch_mean_loss
    assert [len(line.get_xdata()) for line in panels[0].get_lines()] == [2]


def test_no_skipped_steps_figure_unless_a_step_was_skipped(tmp_path: Path, drawn: dict) -> None:
    history = [{"step": s, "loss": 1.0, "skipped_optimizer_steps": 0, "nan_guard_skipped_steps": 0} for s in (1, 2, 3)]
    write_report([make_run(tmp_path / "clean", history)], tmp_path / "clean_out")
    assert "skipped_steps" not in drawn and not (tmp_path / "clean_out" / "skipped_steps.png").exists()
    history[2]["skipped_optimizer_steps"] = 1
    write_report([make_run(tmp_path / "skipped", history)], tmp_path / "skipped_out")
    assert (tmp_path / "skipped_out" / "skipped_steps.png").is_file()
    assert all(t.is_integer() for t in visible_ticks(drawn["skipped_steps"].axes[0], "y"))


def test_an_evaluation_after_the_last_step_does_not_replace_the_one_made_in_training(tmp_path: Path) -> None:
    """With --load_best_model_at_end train() evaluates the best checkpoint's model at the last step: the curve keeps
    the evaluation made at that step; the summary's final metrics are the saved model's (all_results.json)."""
    history = [{"step": 5, "loss": 1.0}, {"step": 5, "eval_accuracy": 0.6}, {"step": 10, "loss": 0.8}]
    history += [{"step": 10, "eval_accuracy": 0.7}, {"step": 10, "eval_accuracy": 0.9, "eval_perplexity": 3.0}]
    run_dir = make_run(tmp_path / "run", history)
    (run_dir / "all_results.json").write_text(json.dumps({"eval_accuracy": 0.9, "eval_perplexity": 3.0}))
    run = load_run(run_dir)
    assert run.eval_series("eval_accuracy") == ([5, 10], [0.6, 0.7])
    assert run.eval_series("eval_perplexity") == ([10], [3.0])  # what only the later one has still counts
    assert "eval_accuracy 0.9 (step 10)" in dict(summary_rows(run))["final metrics"]


# -- who wrote it, and why throughput is missing ----------------------------------------------------------------


class _Trainer:
    def __init__(self, output_dir: Path) -> None:
        self.args = SimpleNamespace(output_dir=str(output_dir))

    def is_world_process_zero(self) -> bool:
        return True


def _header(page: Path) -> str:
    return re.search(r"<p class='meta'>written [\d\- :]+ by ([^<]*)</p>", page.read_text(encoding="utf-8")).group(1)


def test_the_header_says_who_wrote_the_report(tmp_path: Path, monkeypatch) -> None:
    run_dir = make_run(tmp_path / "run", one_log())
    assert _header(write_report([run_dir], tmp_path / "out")) == "trainer-ext report"
    callback = ReportCallback(trainer := _Trainer(run_dir))
    monkeypatch.setattr(sys, "argv", ["/venv/bin/trainer-ext", "train", "--max_steps", "5"])
    assert _header(callback._write(partial=False)) == "trainer-ext train when training ended"
    assert _header(callback._write(partial=True, step=5)) == "trainer-ext train at checkpoint-5, while training"
    monkeypatch.setattr(sys, "argv", ["my_script.py"])
    assert _header(callback._write(partial=False)) == "trainer_ext.train() when training ended"
    del trainer


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("plain", "not logged: a plain Trainer run: add trainer_ext.callbacks.ThroughputCallback to its callbacks"),
        (
            "report_off",
            "not logged: this train() job ran with --report_plots false, which leaves ThroughputCallback out",
        ),
        ("job", "not logged: none of its 2 training log lines carries samples/s"),
        ("no_train_line", "not logged: the run logged no training line (--logging_steps not reached yet, or"),
    ],
)
def test_the_throughput_row_says_why_it_is_missing(kind: str, says: str, tmp_path: Path) -> None:
    history = (
        [{"step": 1, "eval_loss": 1.0}] if kind == "no_train_line" else [{"step": s, "loss": 1.0} for s in (1, 2)]
    )
    run_dir = make_run(tmp_path / "run", history)
    if kind in ("report_off", "job", "no_train_line"):
        (run_dir / "trainer_ext_run.json").write_text(json.dumps({"job": {"task": "causal-lm"}}))
    if kind in ("job", "no_train_line"):
        event = {"event": "start", "time": time.time() - 60, "step": 0, "host": "elsewhere", "pid": 1}
        end = {"event": "end", "time": time.time() - 50, "step": 2, "status": "finished"}
        (run_dir / "trainer_ext_events.jsonl").write_text(json.dumps(event) + "\n" + json.dumps(end) + "\n")
    assert dict(summary_rows(load_run(run_dir)))["throughput"].startswith(says)


def test_a_checkpoint_before_the_first_log_line_writes_nothing_and_warns_nothing(tmp_path: Path, caplog) -> None:
    """The causal-LM example used to save at step 15 with nothing logged before step 50: 'empty log' warnings."""
    callback = ReportCallback(trainer := _Trainer(tmp_path))
    args = SimpleNamespace(output_dir=str(tmp_path))
    state = SimpleNamespace(log_history=[], is_world_process_zero=True, global_step=15)
    callback._write_seconds = 0.0  # no rate limit: a report would be written if there were anything to plot
    with caplog.at_level(logging.WARNING, logger="trainer_ext.report"):
        callback.on_save(args, state, None)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert callback.written == [] and not (tmp_path / "report").exists()
    del trainer


# -- a real 5-step run with one log line, through the CLI, in a browser ------------------------------------------


@pytest.mark.slow
def test_a_five_step_run_logged_once_in_a_browser(tmp_path: Path, drawn: dict) -> None:
    out = tmp_path / "run"
    flags = ["--max_steps", "5", "--logging_steps", "5", "--max_train_samples", "160", "--max_eval_samples", "32"]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", "train", "--output_dir", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = out / "report"
    names = ["loss_vs_step", "loss_vs_tokens", "learning_rate", "grad_norm", "throughput", "timeline"]
    assert {p.stem for p in report.glob("*.png")} == set(names)
    assert _header(report / "report.html") == "trainer-ext train when training ended"
    run = load_run(out)
    assert len(run.series("loss")[0]) == 1 and len(run.eval_series("eval_loss")[0]) == 1
    assert dict(summary_rows(run))["throughput"].startswith("median ")
    write_report([out], tmp_path / "again")  # the same figures, drawn here to look at their axes
    ((step,), (loss,)) = run.series("loss")
    assert (
        colour_at(tmp_path / "again" / "loss_vs_step.png", drawn["loss_vs_step"].axes[0], step, loss, COLOURS[0]) >= 20
    )
    assert all(t.is_integer() for t in visible_ticks(drawn["loss_vs_step"].axes[0]))

    import matplotlib.image

    heights = [matplotlib.image.imread(str(report / f"{n}.png")).shape[0] for n in names]
    shot = tmp_path / "shot.png"
    screenshot(
        report / "report.html", shot, tmp_path / "profile", (1200, 1400 + sum(h * 10 // 9 + 120 for h in heights))
    )
    image = pixels(shot)
    boxes = figure_boxes(image)
    assert len(boxes) == len(names), boxes  # every figure is on the page, drawn at its size, in page order
    for box, name in zip(boxes, names, strict=True):
        top, bottom, left, right = box
        width, height = right - left, bottom - top
        png_height = matplotlib.image.imread(str(report / f"{name}.png")).shape[0]
        assert abs(height / width - png_height / 900) < 0.01, (name, box)
        scores = {other: shown_like(image, box, report / f"{other}.png") for other in names}
        assert scores[name] > 0.93 and max(scores, key=scores.get) == name, (name, scores)
