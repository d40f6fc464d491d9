"""The GPU kit's orchestrator (benchmarks/gpu_check.py): each step in its own process group, time-boxed and
independent; figures kept when a step is stopped; the outputs rewritten after every step; exit status and argument
errors. The steps themselves run in CI's dry run (``benchmarks/gpu_check.py --dry_run``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import Step, run_steps
from benchmarks.gpu_kit.kit import peak_bf16_flops, rel_diff

ROOT = Path(__file__).resolve().parent.parent
BOX = 5.0  # the hanging step's time box (the tests scale subprocess timeouts): well above a tiny step's start-up


def _step(name: str, box: float = 120.0) -> Step:
    return Step(name, "tests.helpers.kit_steps", box, box, 1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it has stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_one_step_failing_hanging_or_skipping_does_not_stop_the_rest(tmp_path: Path) -> None:
    steps = [_step("hangs", BOX), _step("crashes"), _step("skips"), _step("finds"), _step("fine")]
    report = run_steps(steps, dry_run=True, device="cpu", out=tmp_path, budget_s=600, work=tmp_path / "work")
    status = {name: rec["status"] for name, rec in report["steps"].items()}
    assert status == {"hangs": "timeout", "crashes": "failed", "skips": "skipped", "finds": "problems", "fine": "ok"}
    hangs = report["steps"]["hangs"]
    assert hangs["figures"]["before_the_hang"] == 1  # what it recorded before the box closed
    assert not _alive(hangs["figures"]["grandchild"])  # its whole process group went with it
    assert "ValueError: the step broke" in report["steps"]["crashes"]["error"]
    assert report["steps"]["crashes"]["figures"]["before_the_crash"] == 1
    assert report["steps"]["skips"]["figures"]["skipped"] == "nothing to check here"
    assert report["steps"]["finds"]["problems"] == ["value is 2.0, expected 1.0"]
    assert report["steps"]["fine"]["figures"] == {"value": 1.0, "dry_run": True, "device": "cpu"}
    assert report["exit"] == 1


def test_outputs_are_written_and_read_back(tmp_path: Path) -> None:
    report = run_steps([_step("fine"), _step("skips")], True, "cpu", tmp_path, 600, work=tmp_path / "work")
    assert report["exit"] == 0  # ok and skipped steps are a clean run
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["steps"]["fine"]["status"] == "ok" and data["exit"] == 0
    assert "output" not in data["steps"]["fine"]  # the steps' output goes to the log, not the JSON
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "| fine | ok |" in summary and "- value 1.0" in summary and "- skipped: nothing to check here" in summary
    assert "===== fine (ok" in (tmp_path / "gpu_check.log").read_text()


def test_steps_past_the_budget_are_not_started(tmp_path: Path) -> None:
    budget = gpu_check.MIN_STEP_S + 0.5  # the first step (a second at least) leaves less than a step's minimum
    report = run_steps([_step("naps"), _step("fine2")], True, "cpu", tmp_path, budget, work=tmp_path / "work")
    assert report["steps"]["naps"]["status"] in ("ok", "timeout")
    assert report["steps"]["fine2"]["status"] == "not_run"
    assert "out of budget" in report["steps"]["fine2"]["problems"][0]
    assert report["exit"] == 1


def test_a_real_step_through_the_child(tmp_path: Path) -> None:
    """The env step, as CI's dry run and the GPU run start it: versions recorded, trainer_ext imports without
    accelerate."""
    report = run_steps([gpu_check.STEPS[0]], True, "cpu", tmp_path, 600, work=tmp_path / "work")
    env = report["steps"]["env"]
    assert env["status"] == "ok", env
    assert env["figures"]["device_name"] == "cpu" and env["figures"]["torch"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", *args], cwd=ROOT, capture_output=True, text=True, env=env
    )


def test_unknown_step_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = _cli("--dry_run", "--only", "env,warp", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gpu_check: unknown step warp; the steps are " + ", ".join(s.name for s in gpu_check.STEPS)
    ]
    assert not (tmp_path / "gpu_check.json").exists()


def test_without_a_gpu_it_asks_for_the_dry_run(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = _cli("--only", "env", "--out", str(tmp_path), env=env)
    assert proc.returncode == 2
    assert "no CUDA GPU here" in proc.stderr and "--dry_run" in proc.stderr


def test_every_step_module_has_run_and_summarize() -> None:
    import importlib

    for step in gpu_check.STEPS:
        module = importlib.import_module(step.module)
        assert callable(module.run) and callable(module.summarize), step.module
        assert step.expected_s < step.box_s, step  # each box leaves room over what the step is expected to take
    assert sum(s.expected_s for s in gpu_check.STEPS) <= 9 * 60  # the bound for the whole GPU run


def test_figures_helpers() -> None:
    assert rel_diff([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="different lengths"):
        rel_diff([1.0], [1.0, 2.0])
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("cpu") is None
