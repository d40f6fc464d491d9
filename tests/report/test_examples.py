"""Each shipped example config (configs/examples/*.yaml) gives a report with curves, at its first checkpoint and at
the end, and no "empty log" warning: run with its own logging, evaluation and save settings, fewer steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer_ext.report import load_run
from trainer_ext.report.figures import COLOURS
from trainer_ext.report.summary import summary_rows

from .images import count_colour, pixels

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXAMPLES = ROOT / "configs" / "examples"
CURVES = {"loss_vs_step", "loss_vs_tokens", "learning_rate", "grad_norm", "throughput", "timeline"}
# config: (flags that bound the run, evaluations expected at least, first checkpoint or None)
BOUNDS = {
    "causal_lm": (["--max_steps", "30"], 2, 15),  # 15 steps an epoch
    "sequence_classification": (["--max_steps", "40", "--max_train_samples", "640"], 2, 20),  # 20 steps an epoch
    "default": (["--max_steps", "75"], 1, None),  # logging_steps 25, evaluated at the end, no checkpoint
}
SILENT = ("empty log", "nothing to plot", "could not be written", "Traceback")


def test_every_shipped_example_is_tested() -> None:
    assert {p.stem for p in EXAMPLES.glob("*.yaml")} == set(BOUNDS)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_an_example_config_reports_curves(name: str, tmp_path: Path) -> None:
    bounds, evals, first_checkpoint = BOUNDS[name]
    out = tmp_path / "run"
    config = EXAMPLES / f"{name}.yaml"
    proc = subprocess.run(
        [sys.executable, str(HERE / "example_job.py"), "--config", str(config), "--output_dir", str(out), *bounds],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [word for word in SILENT if word in proc.stderr], proc.stderr[-3000:]
    run = load_run(out)
    settings = yaml.safe_load(config.read_text())
    assert run.state["logging_steps"] == settings.get("logging_steps", 25)  # the example's own logging, kept
    assert len(run.series("loss")[0]) >= 3
    assert len(run.eval_series("eval_loss")[0]) >= evals
    report = out / "report"
    drawn = {p.stem for p in report.glob("*.png")}
    assert CURVES <= drawn and ("eval_metrics" in drawn) == (name == "sequence_classification")
    for png in report.glob("*.png"):
        assert count_colour(pixels(png), COLOURS[0]) > 300, png.name  # each figure holds the run's curves
    page = (report / "report.html").read_text(encoding="utf-8")
    assert "by trainer_ext.train() when training ended" in page
    assert dict(summary_rows(run))["throughput"].startswith("median ")
    kept = tmp_path / "first_checkpoint_report.html"
    if first_checkpoint is None:
        assert not kept.exists()
        return
    first = kept.read_text(encoding="utf-8")  # the report the job wrote at its first checkpoint, while training
    assert f"at checkpoint-{first_checkpoint}, while training" in first
    assert first.count("<img") >= 4
