"""The hand-written loop examples, launched on 2 CPU processes with `trainer-ext launch`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent


def _launch(script: str, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    cmd = ["trainer-ext", "launch", "--num_processes", "2", "--cpu", str(ROOT / "examples" / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, f"{script}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def test_classifier_example_on_two_processes(tmp_path: Path) -> None:
    flags = "--epochs 2 --max_train_samples 1280 --batch_size 4 --gradient_accumulation_steps 2 --with_tracking"
    out = _launch("nlp_classifier.py", *flags.split(), "--output_dir", str(tmp_path))
    lines = re.findall(r"eval_accuracy=([\d.]+) eval_samples=(\d+)", out)
    assert len(lines) == 2, "accelerator.print prints on the main process only (once per epoch)"
    accuracy, samples = float(lines[-1][0]), int(lines[-1][1])
    assert samples == 400, "gather_for_metrics must count every eval sample exactly once"
    assert accuracy > 0.65  # chance is ~0.5
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert model.config.num_labels == 2
    assert list(tmp_path.rglob("events.out.tfevents*"))


def test_causal_lm_example_on_two_processes(tmp_path: Path) -> None:
    flags = "--epochs 1 --max_train_samples 640 --mixed_precision bf16"
    out = _launch("causal_lm.py", *flags.split(), "--output_dir", str(tmp_path))
    perplexity = float(re.search(r"eval_perplexity=([\d.]+) \(uniform guess: (\d+)\)", out).group(1))
    vocab = int(re.search(r"uniform guess: (\d+)", out).group(1))
    assert perplexity < vocab / 3, "one epoch must beat guessing by a wide margin"
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(p.dtype == torch.float32 for p in model.parameters())
