"""End to end: the launch scripts run the same `trainer-ext train` on 1 process and on 2 DDP ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, OMP_NUM_THREADS="1", **env)
    environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), environ.get("PATH", "")])
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _eval_metrics(output_dir: Path) -> dict:
    return json.loads((output_dir / "eval_results.json").read_text())


def test_cpu_script_runs_the_default_job(tmp_path: Path) -> None:
    out = tmp_path / "one"
    _run("cpu.sh", "--max_steps", "30", "--output_dir", str(out))
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert not list(out.glob("checkpoint-*"))


def test_multi_cpu_script_runs_the_same_job_on_two_ranks(tmp_path: Path) -> None:
    """Same command, 2 gloo ranks: one saved model, and the same accuracy as one process on batch 2x."""
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    common = ["--max_steps", "30", "--learning_rate", "2e-3", "--seed", "7"]
    _run("multi_cpu.sh", *common, "--per_device_train_batch_size", "16", "--output_dir", str(ddp), NPROC="2")
    _run("cpu.sh", *common, "--per_device_train_batch_size", "32", "--output_dir", str(single))
    assert (ddp / "model.safetensors").exists()
    a, b = _eval_metrics(ddp), _eval_metrics(single)
    assert a["eval_samples"] == b["eval_samples"] == 400
    assert abs(a["eval_accuracy"] - b["eval_accuracy"]) <= 0.01
