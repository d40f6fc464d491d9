"""End to end: ``trainer-ext launch --cpu --num_processes 2 --pp_size 2 train`` trains the causal-LM example with the
tiny-llama-untied preset as a 2-stage pipeline on two gloo processes (and as 4 stages, 2 a rank, with interleaved
1F1B), prints the pipeline in its start-up block, and saves one consolidated model that ``from_pretrained`` loads on
one process with the weights and eval loss of ``trainer-ext train`` on one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
JOB = ["train", "--config", str(ROOT / "configs" / "examples" / "causal_lm.yaml")]
JOB += ["--model_config", "tiny-llama-untied", "--max_steps", "20", "--logging_steps", "5", "--seed", "7"]
JOB += ["--eval_strategy", "no", "--save_strategy", "no", "--report_plots", "false"]  # one eval at the end
# float32, 20 AdamW steps at 2e-3 on batches of 32 x 128 tokens, the same batches in the same order: the pipeline
# computes each microbatch as one process computes its rows; only the loss and the gradients summed over microbatches
# add in another order. Measured with both schedules: weights 1.2e-7 apart at most, eval loss and logged losses 1.5e-7
# relative; training moves every tensor by 1.4e-2 or more.
WEIGHTS, EVAL_LOSS = 1e-5, 2e-6


def _run(argv: list[str], cwd: Path) -> list[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", *argv], capture_output=True, text=True, timeout=500, cwd=cwd, env=env
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-5000:]
    return text.splitlines()


def _results(out: Path) -> tuple[dict[str, torch.Tensor], float, list[float]]:
    """The saved model as ``from_pretrained`` loads it on one process, the final eval loss, the logged losses."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not model.config.tie_word_embeddings and model.config.num_hidden_layers == 4
    state = json.loads((out / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    return model.state_dict(), json.loads((out / "eval_results.json").read_text())["eval_loss"], losses


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[dict[str, torch.Tensor], float, list[float]]:
    out = tmp_path_factory.mktemp("single") / "run"
    _run([*JOB, "--use_cpu", "--output_dir", str(out)], out.parent)
    return _results(out)


@pytest.mark.parametrize(
    ("schedule", "pipeline"),
    [
        ("1f1b", "2 stages (layers 0-1 | 2-3), 1f1b, 2 microbatches, bubble 33%"),
        (
            "interleaved_1f1b",
            "4 stages on 2 ranks (layers 0-0 | 1-1 | 2-2 | 3-3), interleaved_1f1b, 4 microbatches, bubble 11%",
        ),
    ],
)
def test_pipeline_train_job_through_the_launcher_equals_one_process(tmp_path, one_process, schedule, pipeline):
    out = tmp_path / "run"
    launch = ["launch", "--cpu", "--num_processes", "2", "--pp_size", "2", "--pp_schedule", schedule]
    lines = _run([*launch, *JOB, "--output_dir", str(out)], tmp_path)
    assert "  mesh                    = pp 2" in lines
    assert f"  pipeline parallel       = {pipeline}" in lines
    assert any(
        line.startswith("  data-parallel ranks     = 1 (world 2 / 2: the ranks of one pipeline") for line in lines
    )
    assert "  global batch (samples)  = 32 = 1 x 32 x 1" in lines  # the two stages share each batch
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]  # consolidated, not per stage

    weights, eval_loss, losses = _results(out)
    expected, expected_eval, expected_losses = one_process
    assert weights.keys() == expected.keys() and "lm_head.weight" in weights
    assert max(float((weights[k] - expected[k]).abs().max()) for k in expected) < WEIGHTS
    assert abs(eval_loss - expected_eval) < EVAL_LOSS * expected_eval
    assert len(losses) == 4 and losses == pytest.approx(expected_losses, rel=EVAL_LOSS)
