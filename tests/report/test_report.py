"""trainer-ext report: real training runs (CLI and a killed-then-resumed job), real PNGs, a real browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_ext.report import load_run, write_report
from trainer_ext.report.figures import COLOURS, FIGURE_NAMES, smooth
from trainer_ext.report.run import RunData
from trainer_ext.report.summary import _train_command, summary_rows

from .images import count_colour, figure_boxes, pixels, png_size, screenshot, shown_like

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TINY = ["--max_train_samples", "640", "--max_eval_samples", "64", "--logging_steps", "1"]
EXPECTED = {
    "loss_vs_step",
    "loss_vs_tokens",
    "learning_rate",
    "grad_norm",
    "throughput",
    "eval_metrics",
    "timeline",
}  # no skipped_steps: none was skipped


def cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer_ext", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 30-step job through the CLI, checkpoints every 10 steps, eval every 10: its report is written at the end."""
    out = tmp_path_factory.mktemp("finished") / "run"
    flags = ["--max_steps", "30", "--save_steps", "10", "--eval_strategy", "steps", "--eval_steps", "10"]
    proc = cli("train", "--output_dir", str(out), "--save_strategy", "steps", *flags, *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """A 20-step job killed after step 13 (checkpoints at 5, 10), then resumed with --resume_from_checkpoint true."""
    out = tmp_path_factory.mktemp("resumed") / "run"
    flags = [
        "--output_dir",
        str(out),
        "--max_steps",
        "20",
        "--save_strategy",
        "steps",
        "--save_steps",
        "5",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "10",
        *TINY,
    ]
    killed = subprocess.run(
        [sys.executable, str(HERE / "crash_job.py"), "13", *flags],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert killed.returncode == 3, killed.stderr[-3000:]
    assert (out / "report" / "report.html").is_file()  # written at a checkpoint, before the kill
    shutil.copy(out / "report" / "report.html", out.parent / "checkpoint_report.html")  # the resume rewrites it
    assert not (out / "trainer_state.json").exists()
    resumed = cli("train", *flags, "--resume_from_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out


# -- the report written by the train command ------------------------------------------------------------------


@pytest.mark.slow
def test_train_writes_valid_figures_and_a_self_contained_page(finished_run: Path) -> None:
    report = finished_run / "report"
    assert {p.stem for p in report.glob("*.png")} == EXPECTED
    for png in report.glob("*.png"):
        width, height = png_size(png)
        assert width == 900 and 300 <= height <= 1400, (png.name, width, height)
        assert pixels(png).shape == (height, width, 3)  # decodes whole
    page = (report / "report.html").read_text(encoding="utf-8")
    assert page.count("src='data:image/png;base64,") == len(EXPECTED)
    for outside in ("http://", "https://", "<script", "<link", "src='file"):
        assert outside not in page
    assert page.index("<h2>Summary</h2>") < page.index("<img")  # the table comes first


@pytest.mark.slow
def test_summary_table_says_what_the_run_was(finished_run: Path) -> None:
    rows = dict(summary_rows(load_run(finished_run)))
    assert rows["status"] == "finished (step 30 of 30)"
    assert rows["task"] == "sequence-classification"
    assert rows["model"].startswith("tiny-bert (from scratch), BertForSequenceClassification")
    assert "sentiment.jsonl" in rows["data"] and "640 train / 64 eval samples" in rows["data"]
    assert rows["world size and strategy"] == "1 process, single"
    assert rows["precision"] == "fp32 (no mixed precision)"
    assert rows["global batch"].startswith("32 samples = 1 × 32 × 1")
    assert rows["steps"].startswith("30 of 30") and "tokens seen" in rows["steps"]
    assert "eval_loss" in rows["final metrics"] and "eval_baseline_accuracy" in rows["final metrics"]
    assert "eval_accuracy" in rows["best metrics"]
    assert rows["model saved in"].startswith(str(finished_run.resolve()))
    assert "trainer-ext train" in rows["how to resume"] and "--resume_from_checkpoint true" in rows["how to resume"]
    assert "samples/s" in rows["throughput"] and "tokens/s" in rows["throughput"]


@pytest.mark.slow
def test_the_run_data_behind_the_curves(finished_run: Path) -> None:
    run = load_run(finished_run)
    steps, losses = run.series("loss")
    assert steps == list(range(1, 31)) and len(losses) == 30
    assert run.eval_series("eval_loss")[0] == [10, 20, 30]
    assert [c.step for c in run.checkpoints] == [10, 20, 30] and all(c.complete for c in run.checkpoints)
    tokens = run.tokens_at(steps)
    assert tokens[0] > 0 and all(b > a for a, b in zip(tokens, tokens[1:], strict=False))
    assert run.resumes == [] and [s.status for s in run.segments] == ["finished"]


# -- interruption and resume ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_resumed_run_is_one_curve_with_the_resume_marked(resumed_run: Path) -> None:
    run = load_run(resumed_run)
    steps, _ = run.series("loss")
    assert steps == list(range(1, 21))  # continuous: the killed session's steps 11-12 are replaced, not doubled
    assert [s.status for s in run.segments] == ["interrupted", "finished"]
    (resume,) = run.resumes
    assert (resume.step, resume.after, resume.redone_steps) == (10, "interrupted", 2)
    assert [c.step for c in run.checkpoints] == [5, 10, 15, 20]
    tokens = run.tokens_at(steps)  # the token count goes on from the checkpoint too
    assert all(b > a for a, b in zip(tokens, tokens[1:], strict=False))
    rows = dict(summary_rows(run))
    assert "over 2 sessions (1 resume)" in rows["wall time"]
    page = (resumed_run / "report" / "report.html").read_text(encoding="utf-8")
    assert "resumed from checkpoint-10" in page and "2 steps trained again" in page


@pytest.mark.slow
def test_the_report_at_a_checkpoint_says_the_run_is_training(resumed_run: Path) -> None:
    """Written by the training process itself, at checkpoint-10: the run is in progress, not 'interrupted'."""
    page = (resumed_run.parent / "checkpoint_report.html").read_text(encoding="utf-8")
    assert re.search(r"still training, at step \d+ of 20 \(partial report\)", page), page
    assert "The run is still training: this is a partial report." in page
    assert "crash or kill" not in page


@pytest.mark.slow
def test_the_resume_is_drawn(resumed_run: Path, tmp_path: Path) -> None:
    """The dashed resume line is drawn in the run's colour: more of that colour than without the resume."""
    write_report([resumed_run], tmp_path / "with")
    bare = tmp_path / "bare"
    shutil.copytree(resumed_run, bare, ignore=shutil.ignore_patterns("report"))
    events = [
        line for line in (bare / "trainer_ext_events.jsonl").read_text().splitlines() if '"resumed": true' not in line
    ]
    (bare / "trainer_ext_events.jsonl").write_text("\n".join(events) + "\n")
    write_report([bare], tmp_path / "without")
    assert load_run(bare).resumes == []
    drawn = count_colour(pixels(tmp_path / "with" / "learning_rate.png"), COLOURS[0])
    plain = count_colour(pixels(tmp_path / "without" / "learning_rate.png"), COLOURS[0])
    assert drawn > plain + 250, (drawn, plain)


# -- overlays ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_runs_overlay(finished_run: Path, resumed_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "compare"
    proc = cli("report", str(finished_run), str(resumed_run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "report written to" in proc.stdout
    image = pixels(out / "loss_vs_step.png")
    assert count_colour(image, COLOURS[0]) > 500 and count_colour(image, COLOURS[1]) > 500
    page = (out / "report.html").read_text(encoding="utf-8")
    for run in (finished_run, resumed_run):  # both folders are called "run": labelled by their parent too
        assert f"{run.parent.name}/run" in page
    assert page.count("<tr><th>status</th>") == 1 and page.count("finished (step") == 2  # one row, two columns


# -- the browser --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_page_renders_in_a_headless_browser(finished_run: Path, tmp_path: Path) -> None:
    import numpy as np

    report = finished_run / "report"
    order = [n for n in FIGURE_NAMES if n in EXPECTED]  # the page's order
    heights = [png_size(report / f"{n}.png")[1] for n in order]
    size = (1200, 1400 + sum(h * 10 // 9 + 120 for h in heights))
    shot = tmp_path / "shot.png"
    screenshot(report / "report.html", shot, tmp_path / "profile", size)
    image = pixels(shot)
    as_bytes = (image * 255).round().astype(np.uint8)
    assert len(np.unique(as_bytes.reshape(-1, 3), axis=0)) > 200
    boxes = figure_boxes(image)
    assert len(boxes) == len(EXPECTED), boxes  # each figure drawn at its size, none a broken-image box
    for box, name in zip(boxes, order, strict=True):
        scores = {other: shown_like(image, box, report / f"{other}.png") for other in order}
        assert scores[name] > 0.93 and max(scores, key=scores.get) == name, (name, scores)
    assert count_colour(image, COLOURS[0], tolerance=0.08) > 1000  # the run's blue is on screen


# -- bad input: one `error:` line, exit code 2 ------------------------------------------------------------------


def _still_training(folder: Path, finished_run: Path) -> subprocess.Popen:
    """A copy of a run whose event log says it is being trained by a live process (a `sleep`)."""
    shutil.copytree(finished_run, folder)
    sleeper = subprocess.Popen(["sleep", "60"])
    events = [json.loads(line) for line in (folder / "trainer_ext_events.jsonl").read_text().splitlines()]
    events = [e for e in events if e["event"] != "end"]
    events[0]["pid"] = sleeper.pid
    (folder / "trainer_ext_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return sleeper


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "file",
        "not_a_run",
        "empty_state",
        "empty_log",
        "bad_json",
        "still_training",
        "no_argument",
        "bad_smoothing",
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(case: str, finished_run: Path, tmp_path: Path) -> None:
    target, extra, sleeper = tmp_path / "run", [], None
    if case == "file":
        target.write_text("x")
    elif case == "not_a_run":
        target.mkdir()
        (target / "notes.txt").write_text("hello")
    elif case in ("empty_state", "empty_log", "bad_json"):
        target.mkdir()
        text = {
            "empty_state": "",
            "empty_log": json.dumps({"global_step": 0, "log_history": []}),
            "bad_json": '{"log_history": [{"loss": 1',
        }[case]
        (target / "trainer_state.json").write_text(text)
    elif case == "still_training":
        sleeper = _still_training(target, finished_run)
    elif case == "bad_smoothing":
        extra = ["--smoothing", "1.5"]
    try:
        args = ["report"] if case == "no_argument" else ["report", str(target), *extra]
        proc = cli(*args, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        if case == "still_training":
            assert "still training" in lines[0] and str(sleeper.pid) in lines[0]
            partial = cli("report", str(target), "--partial", "--out", str(tmp_path / "partial"), timeout=60)
            assert partial.returncode == 0, partial.stderr
            assert "partial report" in (tmp_path / "partial" / "report.html").read_text(encoding="utf-8")
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
    if case == "empty_log":
        assert "empty log" in lines[0]
    if case == "not_a_run":
        assert "not a training run folder" in lines[0]


def test_without_matplotlib_the_message_names_the_extra(finished_run: Path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from trainer_ext.cli.main import main\n"
        f"sys.exit(main(['report', {str(finished_run)!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: the report's figures need matplotlib, which is not installed: pip install 'matplotlib>=3.7'"
    )


@pytest.mark.slow
def test_report_plots_false_writes_no_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli("train", "--output_dir", str(out), "--max_steps", "3", "--report_plots", "false", *TINY)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "trainer_state.json").is_file()
    assert not (out / "report").exists() and not (out / "trainer_ext_events.jsonl").exists()


# -- the pieces, without a run ----------------------------------------------------------------------------------


def _run_from_history(tmp_path: Path, history: list[dict]) -> RunData:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "trainer_state.json").write_text(
        json.dumps({"global_step": history[-1]["step"], "log_history": history})
    )
    return load_run(tmp_path)


def test_skipped_step_counters_survive_a_restart(tmp_path: Path) -> None:
    """The fp16 counter is cumulative per process: 0,2,2 then (new process) 1,1 means 2 skips then 1."""
    counts = [0, 2, 2, 1, 1]
    history = [
        {"step": s, "loss": 1.0, "skipped_optimizer_steps": c} for s, c in zip((1, 2, 3, 4, 5), counts, strict=False)
    ]
    run = _run_from_history(tmp_path, history)
    assert run.skip_events("skipped_optimizer_steps") == [(2, 2), (4, 1)]
    write_report([tmp_path], tmp_path / "out")
    assert png_size(tmp_path / "out" / "skipped_steps.png")[0] == 900


def test_a_plain_trainer_folder_reports_without_events(tmp_path: Path) -> None:
    """transformers' own output_dir (no trainer_ext files): the curves, and 'unknown' where nothing says."""
    history = [{"step": s, "loss": 2.0 / s, "learning_rate": 1e-3, "grad_norm": 1.0} for s in range(1, 6)]
    run = _run_from_history(tmp_path, history)
    page = write_report([tmp_path], tmp_path / "out")
    assert {p.stem for p in page.parent.glob("*.png")} == {"loss_vs_step", "learning_rate", "grad_norm"}
    assert set(FIGURE_NAMES) >= {p.stem for p in page.parent.glob("*.png")}
    assert dict(summary_rows(run))["precision"] == "unknown (not recorded)"


def test_smoothing_is_the_debiased_moving_average() -> None:
    assert smooth([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])
    assert smooth([0.0, 1.0], 0.5) == pytest.approx([0.0, 2 / 3])
    assert smooth([3.0, 5.0], 0.0) == [3.0, 5.0]


def test_the_resume_command_drops_the_start_over_flags() -> None:
    argv = [
        "/venv/bin/trainer-ext",
        "train",
        "--max_steps",
        "9",
        "--overwrite_output_dir",
        "true",
        "--resume_from_checkpoint=auto",
        "--output_dir",
        "o",
    ]
    assert _train_command(argv, Path("o")) == (
        "trainer-ext train --max_steps 9 --output_dir o --resume_from_checkpoint true"
    )
    assert _train_command(["script.py", "--x"], Path("o")) is None
