"""Bad DeepSpeed input through ``trainer-ext train`` and ``trainer-ext launch``, and the dry run's resolved config.

Every check here is config logic: the deepspeed package is pretended present where ``train`` asks for it,
so these tests run (and the messages are the same) without it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import trainer_ext.trainer.training_args
from trainer_ext.cli.launch import prepare
from trainer_ext.cli.main import main
from trainer_ext.job.flags import parse_train_args

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "deepspeed"
ZERO2 = str(PRESETS / "zero2.json")


def _find_spec_with(monkeypatch: pytest.MonkeyPatch, deepspeed: object) -> None:
    """``find_spec("deepspeed")`` as seen by the TrainingArguments answers ``deepspeed``; other names as usual."""
    real = importlib.util.find_spec
    fake = lambda name, *args: deepspeed if name == "deepspeed" else real(name, *args)  # noqa: E731
    monkeypatch.setattr(trainer_ext.trainer.training_args.importlib.util, "find_spec", fake)


@pytest.fixture(autouse=True)
def deepspeed_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config checks run before deepspeed is imported: pretend it is installed; keep the environment clean."""
    _find_spec_with(monkeypatch, importlib.util.find_spec("deepspeed") or object())
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what the arguments set on CPU; restored after the test


@pytest.fixture
def hf_registry():
    """Restore transformers' DeepSpeed registration (a valid config registers itself)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    yield
    hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def write_json(tmp_path: Path, config: dict | str) -> str:
    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config, indent=2))
    return str(path)


def train_error(capsys, tmp_path: Path, *flags: str) -> str:
    """Run ``trainer-ext train`` in-process; it must exit 2 with an ``error:`` message and write nothing."""
    out = tmp_path / "out"
    assert main(["train", "--output_dir", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert not out.exists()
    return err


CONFLICTING = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_clipping": 0.5,
    "zero_optimization": {"stage": 2},
}


# -- trainer-ext train ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{\n  "zero_optimization": {"stage": 2,}\n}', "is not valid JSON: line 2, column 36"),
        ({"zero_optimization": {"stage": 4}}, "unknown ZeRO stage 4 in zero_optimization.stage; valid stages are"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            "zero_optimization.offload_param.device is 'nvme' but no path is given; add \"nvme_path\"",
        ),
    ],
    ids=["malformed-json", "unknown-stage", "nvme-without-path"],
)
def test_bad_deepspeed_config_is_one_error_line(capsys, tmp_path, config, message):
    path = write_json(tmp_path, config)
    err = train_error(capsys, tmp_path, "--deepspeed", path)
    assert message in err and path in err
    assert err.count("\n") == 1


def test_deepspeed_together_with_fsdp_is_refused(capsys, tmp_path):
    err = train_error(capsys, tmp_path, "--deepspeed", ZERO2, "--fsdp", "full_shard")
    assert "--fsdp and --deepspeed both shard the model; choose one" in err and err.count("\n") == 1


def test_every_value_contradicting_the_flags_is_listed(capsys, tmp_path):
    path = write_json(tmp_path, CONFLICTING)
    flags = ["--deepspeed", path, "--per_device_train_batch_size", "4", "--max_grad_norm", "1.0"]
    err = train_error(capsys, tmp_path, *flags)
    assert f"DeepSpeed config {path} contradicts the TrainingArguments" in err
    assert "train_micro_batch_size_per_gpu=8 in the DeepSpeed config but --per_device_train_batch_size=4" in err
    assert "gradient_clipping=0.5 in the DeepSpeed config but --max_grad_norm=1.0" in err


def test_missing_deepspeed_names_the_extra(capsys, tmp_path, monkeypatch):
    _find_spec_with(monkeypatch, None)
    err = train_error(capsys, tmp_path, "--deepspeed", ZERO2)
    assert "pip install 'deepspeed>=0.16'" in err and err.count("\n") == 1


# -- trainer-ext launch --dry_run -------------------------------------------------------------------
def dry_run(capsys, *argv: str) -> tuple[dict, str]:
    """The resolved DeepSpeed config the dry run prints, and the whole output."""
    assert main(["launch", "--dry_run", *argv]) == 0
    out = capsys.readouterr().out
    block = out.split('"auto" values resolved from the launch and train arguments:\n')[1].split("  resolved from:")[0]
    return json.loads(block), out


def test_dry_run_shows_the_resolved_deepspeed_config(gpus, capsys):
    argv = ["--deepspeed", ZERO2, "--num_processes", "2", "--cpu", "train"]
    config, out = dry_run(capsys, *argv, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 16  # 2 processes x 4 x 2
    assert config["gradient_clipping"] == 1.0 and config["fp16"]["enabled"] is False
    assert config["bf16"]["enabled"] is False and config["zero_optimization"]["stage"] == 2
    assert config["zero_optimization"]["reduce_bucket_size"] == "auto"  # needs the model: filled at training start
    assert "world size 2: 2 process(es) per machine x 1 machine(s)" in out
    assert "per_device_train_batch_size 4: train --per_device_train_batch_size" in out
    assert "max_grad_norm 1.0: TrainingArguments default" in out
    assert 'still "auto" until training starts' in out and "zero_optimization.reduce_bucket_size" in out


def test_dry_run_takes_launch_settings_config_files_and_defaults(gpus, capsys, tmp_path):
    launch_config = tmp_path / "launch.yaml"
    launch_config.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {ZERO2}\n")
    job = tmp_path / "job.yaml"
    job.write_text("per_device_train_batch_size: 3\n")
    argv = ["--config_file", str(launch_config), "--num_processes", "2", "--cpu", "--mixed_precision", "bf16"]
    config, out = dry_run(capsys, *argv, "--gradient_accumulation_steps", "5", "train", "--config", str(job))
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["train_batch_size"] == 2 * 3 * 5
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert f"per_device_train_batch_size 3: train --config {job}" in out
    assert "gradient_accumulation_steps 5: launch gradient_accumulation_steps (command line" in out
    assert "bf16 true: launch mixed_precision (command line --mixed_precision)" in out
    config, out = dry_run(capsys, "--deepspeed", ZERO2, "--cpu", "train")
    assert config["train_micro_batch_size_per_gpu"] == 32  # the built-in job trains from scratch
    assert "per_device_train_batch_size 32: default for a model from scratch" in out


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"zero_optimization": {"stage": 2}', "is not valid JSON: line 1, column 35"),
        ({"zero_optimization": {"stage": "three"}}, "unknown ZeRO stage 'three'"),
    ],
    ids=["malformed-json", "unknown-stage"],
)
def test_dry_run_refuses_a_bad_deepspeed_config(gpus, capsys, tmp_path, config, message):
    path = write_json(tmp_path, config)
    assert main(["launch", "--dry_run", "--deepspeed", path, "--cpu", "train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot launch (1 problem):") and message in err and "Traceback" not in err


def test_dry_run_lists_every_conflict_with_the_train_flags(gpus, capsys, tmp_path):
    path = write_json(tmp_path, CONFLICTING)
    argv = ["launch", "--dry_run", "--deepspeed", path, "--num_processes", "2", "--cpu", "train"]
    assert main([*argv, "--per_device_train_batch_size", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot launch (1 problem):") and "Traceback" not in err
    assert "train_micro_batch_size_per_gpu=8 in the DeepSpeed config but --per_device_train_batch_size=4" in err
    assert "gradient_clipping=0.5 in the DeepSpeed config but --max_grad_norm=1.0" in err


def test_dry_run_shows_what_train_resolves(gpus, capsys, tmp_path, hf_registry):
    """One process: the dry run's config equals the one the train arguments build (no process group needed)."""
    job = tmp_path / "job.yaml"
    job.write_text("per_device_train_batch_size: 3\nmax_grad_norm: 0.7\n")
    train_args = ["--config", str(job), "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "o")]
    settings, plan, _ = prepare(["--deepspeed", ZERO2, "--cpu", "--mixed_precision", "bf16", "train", *train_args])
    assert plan.torchrun_args is None and settings.world_size == 1
    args = parse_train_args(plan.command[plan.command.index("train") + 1 :])
    assert plan.deepspeed.config == args.hf_deepspeed_config.config
