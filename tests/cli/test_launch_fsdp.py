"""``trainer-ext launch ... train`` with FSDP: the settings are parsed before any process starts, as train will."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from trainer_ext.cli.launch import prepare
from trainer_ext.cli.main import main

PRESETS = sorted((Path(__file__).resolve().parents[2] / "configs" / "fsdp").glob("*.yaml"))
CPU2 = ["--cpu", "--num_processes", "2"]


def launch_error(capsys, *argv: str) -> str:
    """``launch --dry_run ARGV`` must be refused (the dry run: a launcher that failed to refuse starts nothing)."""
    assert main(["launch", "--dry_run", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: cannot launch (1 problem)" in err
    return err


def test_a_bad_inline_fsdp_config_is_refused_with_every_mistake(gpus, tmp_path, capsys):
    config = tmp_path / "launch.yaml"
    fsdp = {"fsdp_sharding_strategy": "NO_SHARD", "fsdp_auto_wrap_polcy": "TRANSFORMER_BASED_WRAP"}
    values = {"distributed_type": "FSDP", "num_processes": 2, "use_cpu": True, "fsdp_config": fsdp}
    config.write_text(yaml.safe_dump(values))
    err = launch_error(capsys, "--config_file", str(config), "train")
    assert f"FSDP settings from config file {config}, accelerate key fsdp_config:" in err
    assert "sharding_strategy NO_SHARD replicates the whole model" in err
    assert "unknown key 'fsdp_auto_wrap_polcy'. Did you mean 'auto_wrap_policy'" in err


def test_fsdp_on_one_process_goes_through_torchrun(gpus):
    """One FSDP process needs a process group (of one): torchrun on loopback, as for --max_restarts."""
    settings, plan, _ = prepare(["--cpu", "--fsdp_config", str(PRESETS[0]), "train"])
    args = plan.torchrun_args
    assert plan.command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert args[args.index("--nproc_per_node") + 1] == "1" and args[args.index("--rdzv_endpoint") + 1] == "127.0.0.1:0"
    assert plan.fsdp is not None and "FSDP on one process" in settings.sources["main_process_ip"]
    assert any("for a process group of one" in note for note in plan.notes)


@pytest.mark.parametrize(
    ("script_args", "torchrun"),
    [
        (["--fsdp", "full_shard", "--bf16"], True),
        (["--fsdp=full_shard auto_wrap"], True),
        (["--fsdp", "", "--bf16"], False),
        (["--fsdp", "false"], False),
        (["--bf16"], False),
    ],
)
def test_a_script_given_fsdp_goes_through_torchrun_on_one_process(gpus, tmp_path, script_args, torchrun):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    _, plan, _ = prepare(["--cpu", str(script), *script_args])
    assert (plan.torchrun_args is not None) is torchrun
    assert plan.command[-len(script_args) - 1 :] == [str(script), *script_args]


def test_the_users_own_fsdp_flags_are_checked_too(gpus, capsys):
    err = launch_error(capsys, *CPU2, "train", "--fsdp", "--fsdp_config", '{"fsdp_min_num_params": "big"}')
    assert "FSDP settings from train --fsdp_config: fsdp_config: min_num_params must be a whole number" in err


def test_dry_run_shows_the_resolved_fsdp_settings(gpus, tmp_path, capsys):
    config = tmp_path / "fsdp.yaml"
    config.write_text("fsdp_version: 2\nfsdp_reshard_after_forward: false\nfsdp_use_orig_params: true\n")
    assert main(["launch", *CPU2, "--fsdp_config", str(config), "--dry_run", "train", "--bf16"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    block = out.split("FSDP2 settings from command line --fsdp_config, as train will apply them (fully_shard):\n")[1]
    lines = block.split("notes:")[0].splitlines()
    assert lines[:2] == ["  reshard_after_forward: false", "  auto_wrap_policy: transformer"]
    assert lines[2] == "  transformer_layer_cls_to_wrap: the model's _no_split_modules"
    assert "  cpu_offload: false" in lines and "  param_dtype: from --bf16/--fp16, else float32" in lines
    assert "fsdp_config: ignoring fsdp_use_orig_params" in out.split("notes:")[1]  # a note, not a stray log line
    assert "ignoring" not in captured.err


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_shipped_fsdp_preset_passes_the_launch_check(gpus, preset):
    _, plan, _ = prepare([*CPU2, "--fsdp_config", str(preset), "train"])
    assert plan.fsdp is not None and plan.command[-2:] == ["--fsdp_config", str(preset)]
