"""End to end: ``trainer-ext launch --num_processes 2 --tp_size 2 train`` (and ``--cp_size 2``) trains the tiny-llama
preset tensor- (context-) parallel on two gloo processes, prints the mesh in its start-up block, and saves a model that
loads on one process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]


def test_tensor_parallel_train_job_through_the_launcher(tmp_path):
    out = tmp_path / "run"
    argv = ["launch", "--num_processes", "2", "--tp_size", "2", "--cpu", "train", "--task", "causal-lm"]
    argv += ["--max_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size", "4"]
    argv += ["--report_plots", "false", "--output_dir", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", *argv], capture_output=True, text=True, timeout=500, cwd=tmp_path
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    lines = text.splitlines()
    assert "  mesh                    = tp 2" in lines
    assert any(line.startswith("  data-parallel ranks     = 1 (world 2 / 2") for line in lines)
    assert "  global batch (samples)  = 4 = 1 x 4 x 1" in lines  # the two ranks of the TP group share one batch
    assert any("tensor parallel 2 (mesh tp 2) on 2 processes" in line for line in lines)  # the start-up estimate

    state = json.loads((out / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # one process, no mesh: the consolidated weights
    assert model.config.vocab_size % 2 == 0  # the vocabulary from scratch, padded for the row split
    assert Path(out, "model.safetensors").is_file()


def _losses(out: Path) -> list[float]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def test_context_parallel_train_job_through_the_launcher(tmp_path):
    """cp 2 on two gloo processes: both ranks share each batch, split along the sequence; the start-up block names
    the attention, the losses are one process's on the same batches, and the saved model loads on one process."""
    job = ["train", "--task", "causal-lm", "--max_steps", "3", "--logging_steps", "1"]
    job += ["--per_device_train_batch_size", "4", "--report_plots", "false", "--seed", "3"]
    runs = {}
    for name, launch in (("cp", ["--num_processes", "2", "--cp_size", "2"]), ("single", ["--num_processes", "1"])):
        out = tmp_path / name
        proc = subprocess.run(
            [sys.executable, "-m", "trainer_ext", "launch", *launch, "--cpu", *job, "--output_dir", str(out)],
            capture_output=True,
            text=True,
            timeout=500,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        runs[name] = (out, (proc.stdout + proc.stderr).splitlines())
    out, lines = runs["cp"]
    assert "  mesh                    = cp 2" in lines
    assert "  context parallel        = 2 ranks, all_gather attention (auto)" in lines
    assert any(
        line.startswith("  data-parallel ranks     = 1 (world 2 / 2: the ranks of one context-parallel")
        for line in lines
    )
    assert "  global batch (samples)  = 4 = 1 x 4 x 1" in lines  # the two ranks share one batch
    assert any(
        "context parallel 2 (all_gather) x FSDP2 full_shard (mesh cp 2) on 2 processes" in line for line in lines
    )
    losses, reference = _losses(out), _losses(runs["single"][0])
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert losses == pytest.approx(reference, rel=1e-4)  # float32, the same batches: summation order only

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # the consolidated weights, one process
    assert model.config.model_type == "llama" and Path(out, "model.safetensors").is_file()
