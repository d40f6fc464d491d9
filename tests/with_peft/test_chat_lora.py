"""The chat jobs with LoRA for real: ``--task sft --lora_r`` trains and saves only the adapters; ``--task dpo --lora_r``
takes the model with its adapters switched off as the reference, so its first step is exactly DPO's starting point."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("peft")

import trainer_ext  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _flags(task: str, out: Path, *extra: str) -> list[str]:
    base = ["--task", task, "--output_dir", str(out), "--lora_r", "8", "--max_steps", "4", "--logging_steps", "1"]
    base += [
        "--max_train_samples",
        "64",
        "--max_eval_samples",
        "16",
        "--report_plots",
        "false",
        "--learning_rate",
        "1e-2",
    ]
    return [*base, *extra]


def _logs(out: Path) -> list[dict]:
    return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]


def test_sft_with_lora_trains_and_saves_only_the_adapters(tmp_path: Path) -> None:
    out = tmp_path / "sft"
    trainer_ext.train(_flags("sft", out, "--lora_target_modules", "all-linear"))
    names = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names
    assert "model.safetensors" not in names
    logs = _logs(out)
    assert len(logs) == 4 and logs[-1]["loss"] < logs[0]["loss"]


def test_dpo_with_lora_uses_the_model_without_its_adapters_as_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "dpo"
    trainer_ext.train(_flags("dpo", out))
    logs = _logs(out)
    # LoRA's B starts at zero: at step 1 the policy is its reference, every reward 0 and the loss log 2
    assert logs[0]["rewards/margins"] == 0.0 and logs[0]["rewards/chosen"] == 0.0
    assert math.isclose(logs[0]["loss"], math.log(2), rel_tol=1e-6)
    assert any(entry["rewards/margins"] != 0.0 for entry in logs[1:])  # the adapters moved the policy away
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
