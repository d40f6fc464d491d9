"""The recipes in configs/recipes/: every config (real size and tiny) parses with train's parser into valid flags,
and each tiny variant trains end to end through the CLI as its header says, a few steps long: the training loss
falls, DPO's rewards rise, the report is written. The DPO recipe runs from the SFT recipe's output (the chain the
recipes document), and the FSDP2 recipe on 2 CPU processes through ``trainer-ext launch``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from tests.helpers.groups import no_group_left  # noqa: F401
from trainer_ext.job.flags import parse_train_args

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "configs" / "recipes"
NAMES = ("sft_lora", "sft_fsdp", "dpo", "cpt_packing")
CONFIGS = sorted(RECIPES.glob("*.yaml")) + sorted((RECIPES / "tiny").glob("*.yaml"))
PEFT = importlib.util.find_spec("peft") is not None


def _id(path: Path) -> str:
    return str(path.relative_to(RECIPES))


def _values(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# parsing an FSDP train config in this process starts a group of one: torn down after each test
pytestmark = pytest.mark.usefixtures("no_group_left")


@pytest.fixture
def peft_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA flags are checked as if peft were installed (parsing only looks for it; nothing imports it)."""
    if not PEFT:
        stand_in = types.ModuleType("peft")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("peft", None)
        monkeypatch.setitem(sys.modules, "peft", stand_in)


def test_each_recipe_has_a_real_and_a_tiny_variant() -> None:
    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted(NAMES)
    assert sorted(p.stem for p in (RECIPES / "tiny").glob("*.yaml")) == sorted(NAMES)
    for name in NAMES:
        header = (RECIPES / f"{name}.yaml").read_text()
        assert "Memory estimate" in header and "trainer-ext estimate" in header, name
        assert f"configs/recipes/tiny/{name}.yaml" in header, name
        assert f"--config configs/recipes/tiny/{name}.yaml" in (RECIPES / "tiny" / f"{name}.yaml").read_text(), name


def test_dpo_starts_from_the_sft_recipes_output() -> None:
    for folder in (RECIPES, RECIPES / "tiny"):
        sft, dpo = _values(folder / "sft_fsdp.yaml"), _values(folder / "dpo.yaml")
        assert dpo["model_name_or_path"] == sft["output_dir"], folder


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_recipe_parses_into_valid_flags(
    path: Path, tmp_path: Path, peft_present: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the tiny text recipe names the shipped corpus relative to the repository root
    values = _values(path)
    flags = ["--config", str(path), "--output_dir", str(tmp_path / "out")]
    if values["task"] == "dpo":  # its model is the SFT recipe's output, which does not exist yet
        (tmp_path / "sft").mkdir()
        flags += ["--model_name_or_path", str(tmp_path / "sft")]
    args = parse_train_args(flags)
    assert args.task == values["task"]
    for key in ("max_seq_length", "learning_rate", "per_device_train_batch_size", "num_train_epochs", "seed"):
        assert getattr(args, key) == pytest.approx(float(values[key])), key
    assert args.packing == values.get("packing", False)
    assert args.lora_r == values.get("lora_r", 0)
    assert args.report_plots is True
    if path.parent == RECIPES:  # real size: bf16 on a pretrained model
        assert args.bf16 and (args.model_name_or_path or "").strip()
    else:  # tiny: float32 and offline (a preset, the shipped data, or the tiny SFT output)
        assert not args.bf16
        assert values["task"] == "dpo" or "model_name_or_path" not in values
    if values.get("fsdp"):
        assert args.fsdp and args.activation_checkpointing


def _run(cmd: list[str], cwd: Path = ROOT) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


def _train(recipe: str, out: Path, steps: int, *extra: str) -> list[dict]:
    config = str(RECIPES / "tiny" / f"{recipe}.yaml")
    _run(["trainer-ext", "train", "--config", config, "--max_steps", str(steps), "--output_dir", str(out), *extra])
    return _history(out)


def _history(out: Path) -> list[dict]:
    assert (out / "report" / "report.html").is_file(), "report_plots: the report is written"
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def _series(history: list[dict], key: str) -> list[float]:
    return [entry[key] for entry in history if key in entry]


def _falls(history: list[dict]) -> None:
    losses = _series(history, "loss")
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
    assert _series(history, "eval_loss"), "evaluated at the end"


def test_tiny_cpt_packing(tmp_path: Path) -> None:
    _falls(_train("cpt_packing", tmp_path / "cpt", 30))


@pytest.mark.skipif(not PEFT, reason="the LoRA recipe needs peft (pip install -e '.[peft]'); not installed here")
def test_tiny_sft_lora(tmp_path: Path) -> None:
    out = tmp_path / "lora"
    _falls(_train("sft_lora", out, 24))
    assert (out / "adapter_model.safetensors").is_file() and (out / "merged" / "model.safetensors").is_file()


@pytest.mark.distributed
def test_tiny_sft_fsdp_on_two_processes_then_dpo_from_it(tmp_path: Path) -> None:
    sft = tmp_path / "sft"
    config = str(RECIPES / "tiny" / "sft_fsdp.yaml")
    launch = ["trainer-ext", "launch", "--cpu", "--num_processes", "2", "train", "--config", config]
    _run([*launch, "--max_steps", "20", "--output_dir", str(sft)])
    _falls(_history(sft))
    assert (sft / "model.safetensors").is_file() and (sft / "chat_template.jinja").is_file()

    dpo = _train("dpo", tmp_path / "dpo", 46, "--model_name_or_path", str(sft))
    accuracies, margins = _series(dpo, "rewards/accuracies"), _series(dpo, "rewards/margins")
    assert len(accuracies) >= 6 and _series(dpo, "eval_rewards/accuracies")
    first, last = sum(accuracies[:2]) / 2, sum(accuracies[-2:]) / 2
    assert last > first and last > 0.5, accuracies  # the policy learns to rank the chosen answer higher
    assert sum(margins[-2:]) > sum(margins[:2]), margins
    _falls(dpo)
