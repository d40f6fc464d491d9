"""``--parallelism auto``: ``trainer-ext launch ... train`` and ``trainer-ext train`` set the layout to the plan's first
choice for the processes they run, before any process parses its flags; the start-up block names it; nothing that fits,
a bad value and ``train(args)`` from Python are refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_ext import env_vars
from trainer_ext.cli.launch import describe, prepare
from trainer_ext.cli.main import _resolve_parallelism, check_train_flags, main
from trainer_ext.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
# the tiny-llama preset from scratch: 4 heads, 2 key/value heads, tied embeddings; 8 sequences per optimizer step
JOB = ["--model_config", "tiny-llama", "--task", "causal-lm", "--per_device_train_batch_size", "4"]
JOB += ["--gradient_accumulation_steps", "2", "--max_steps", "2"]
SMALL = ["--max_train_samples", "32", "--max_eval_samples", "16", "--report_plots", "false", "--seed", "3"]


@pytest.fixture(autouse=True)
def unresolved(monkeypatch: pytest.MonkeyPatch) -> None:
    """No resolution from an outer launcher; what a test's resolution sets is undone after it."""
    monkeypatch.setenv(env_vars.PARALLELISM_AUTO, "")


def expected(argv: list[str], processes: int) -> tuple[object, list[str], str]:
    """The plan's first layout for ``argv`` on ``processes`` CPU processes (no memory limit), its train flags as the
    resolution writes them (the shipped DeepSpeed config by its absolute path) and the start-up block's text;
    DeepSpeed's layouts only when deepspeed is installed."""
    import importlib.util

    from trainer_ext.estimate.fit import checkpointing_flag
    from trainer_ext.plan.cluster import Cluster
    from trainer_ext.plan.planner import make_plan

    plan = make_plan(argv, Cluster(1, processes, 0, "shm", "ib", "cpu"))
    ranked = plan.ranked
    if importlib.util.find_spec("deepspeed") is None:
        ranked = [c for c in ranked if not c.layout.family.startswith("zero")]
    layout = ranked[0].layout
    flags = layout.flags(checkpointing_flag())
    if "--deepspeed" in flags:
        at = flags.index("--deepspeed") + 1
        flags[at] = str(ROOT / flags[at])
    where = f"{processes} CPU process{'es' * (processes > 1)}"
    if len(ranked) > 1:
        return layout, flags, f"{layout.name()} (first of the {len(ranked)} planned layouts that fit {where})"
    return layout, flags, f"{layout.name()} (the one planned layout that fits {where})"


def _train_args(command: list[str]) -> list[str]:
    return command[command.index("train") + 1 :]


def test_launch_dry_run_shows_the_plans_first_layout_flags():
    user = ["--parallelism", "auto", *JOB]
    settings, plan, dry_run = prepare(["--num_processes", "2", "--cpu", "--dry_run", "train", *user])
    assert dry_run
    layout, flags, text = expected([*user, "--use_cpu"], 2)
    job = ["--parallelism", "auto", "--model_config", "tiny-llama", "--task", "causal-lm", "--max_steps", "2"]
    assert _train_args(plan.command) == [*job, "--use_cpu", *flags]
    assert plan.env[env_vars.PARALLELISM_AUTO] == text
    # the global batch the job asked for is kept: 4 x 2 x 2 ranks
    assert layout.micro_batch * layout.accumulation * layout.data_parallel == 16
    shown = describe(settings, plan)
    assert " ".join(flags[-4:]) in shown.splitlines()[-1]  # the command line carries the resolved flags
    assert f"  - parallelism auto: {text}; its flags: " in shown


def test_a_layout_flag_given_with_auto_fixes_that_part():
    _, plan, _ = prepare(["--num_processes", "2", "--cpu", "train", "--parallelism", "auto", *JOB, "--tp_size", "2"])
    args = _train_args(plan.command)
    assert args[args.index("--tp_size") + 1] == "2" and args.count("--tp_size") == 1
    assert plan.env[env_vars.PARALLELISM_AUTO].startswith("mesh tp 2 ")
    assert plan.parallel is not None and plan.parallel.config.tp_size == 2
    assert plan.env[env_vars.USE_PARALLELISM_CONFIG] == "true"
    # tp 2 leaves one data-parallel rank: the job's global batch is 4 x 2 x 1
    micro = int(args[args.index("--per_device_train_batch_size") + 1])
    assert micro * int(args[args.index("--gradient_accumulation_steps") + 1]) == 8

    _, plan, _ = prepare(
        ["--num_processes", "2", "--cpu", "train", "--parallelism", "auto", *JOB, "--fsdp", "offload"]
    )
    args = _train_args(plan.command)
    assert args[args.index("--fsdp") + 1] == "offload" and args.count("--fsdp") == 1  # the job's own words kept
    assert "offload" in plan.env[env_vars.PARALLELISM_AUTO].split(" (")[0]


def test_a_config_file_asks_for_auto_and_its_layout_keys_give_way(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("parallelism: auto\ngradient_checkpointing: true\nper_device_train_batch_size: 4\n")
    job = ["--config", str(config), "--model_config", "tiny-llama", "--task", "causal-lm"]
    _, plan, _ = prepare(["--num_processes", "2", "--cpu", "train", *job])
    layout, _, _ = expected([*job, "--use_cpu"], 2)
    args = _train_args(plan.command)
    assert env_vars.PARALLELISM_AUTO in plan.env
    from trainer_ext.job.flags import parse_train_values

    values = parse_train_values(args)[0]
    assert values["per_device_train_batch_size"] == layout.micro_batch
    checkpointing = values.get("gradient_checkpointing") or values.get("activation_checkpointing")
    assert bool(checkpointing) == layout.checkpointing  # the file's `true` is overridden when the plan does without


def test_train_under_torchrun_resolves_as_the_launch_does(monkeypatch):
    """Every rank of ``torchrun -m trainer_ext train --parallelism auto`` resolves it from WORLD_SIZE alike, to the
    flags ``launch`` gives."""
    user = ["--parallelism", "auto", *JOB, "--use_cpu"]
    _, plan, _ = prepare(["--num_processes", "2", "--cpu", "train", *user])
    monkeypatch.setenv(env_vars.WORLD_SIZE, "2")
    monkeypatch.setenv(env_vars.LOCAL_WORLD_SIZE, "2")
    resolved = _resolve_parallelism(user, check_train_flags(user))
    assert list(resolved) == _train_args(plan.command)
    assert os.environ[env_vars.PARALLELISM_AUTO] == plan.env[env_vars.PARALLELISM_AUTO]
    # a process a launcher resolved it for keeps its flags as they are
    assert _resolve_parallelism(user, check_train_flags(user)) == user


def test_nothing_fits_is_one_line_before_any_process(tmp_path):
    out = tmp_path / "run"
    proc = _cli(
        ["train", "--parallelism", "auto", *JOB, "--device_memory", "1MiB", "--output_dir", str(out)], tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    # the plan reads the data for its sequence length (datasets' progress bar); then one error line
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("Generating train split")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("error: --parallelism auto: no layout fits 1 CPU process of 1.0 MiB at global batch 8")
    assert "it fits with --device_memory " in lines[0]
    assert not out.exists()

    with pytest.raises(
        ConfigError, match=r"cannot launch \(1 problem\):\n  - --parallelism auto: no layout fits 2 CPU"
    ):
        prepare(["--num_processes", "2", "--cpu", "train", "--parallelism", "auto", *JOB, "--device_memory", "1MiB"])


def test_a_bad_value_is_one_line(capsys):
    assert main(["train", "--parallelism", "foo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --parallelism 'foo' is not one of manual, auto."]


def test_train_from_python_refuses_auto_unresolved():
    from trainer_ext.job.run import train

    with pytest.raises(ConfigError, match=r"^--parallelism auto is resolved by the trainer-ext CLI") as caught:
        train(["--parallelism", "auto", *JOB])
    assert "\n" not in str(caught.value)


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != env_vars.PARALLELISM_AUTO}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "trainer_ext", *argv], capture_output=True, text=True, timeout=500, cwd=cwd, env=env
    )


def _startup_line(text: str) -> str:
    found = [line for line in text.splitlines() if line.startswith("  parallelism             = ")]
    assert len(found) == 1, text[-5000:]
    return found[0].removeprefix("  parallelism             = ")


@pytest.mark.slow
def test_train_auto_on_one_process_prints_its_choice(tmp_path):
    out = tmp_path / "run"
    proc = _cli(["train", "--parallelism", "auto", *JOB, *SMALL, "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    layout, _, text = expected(["--parallelism", "auto", *JOB, *SMALL], 1)
    assert _startup_line(proc.stdout) == f"auto: {text}"
    assert f"  per-device batch        = {layout.micro_batch}" in proc.stdout.splitlines()
    assert (out / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_launch_auto_on_two_cpu_processes_trains_with_the_plans_layout(tmp_path):
    out = tmp_path / "run"
    launch = ["launch", "--num_processes", "2", "--cpu", "train", "--parallelism", "auto"]
    proc = _cli([*launch, *JOB, *SMALL, "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    layout, _, text = expected(["--parallelism", "auto", *JOB, *SMALL, "--use_cpu"], 2)
    assert _startup_line(proc.stdout) == f"auto: {text}"
    lines = proc.stdout.splitlines()
    assert f"  per-device batch        = {layout.micro_batch}" in lines
    assert f"  accumulation steps      = {layout.accumulation}" in lines
    assert any(line.startswith("  global batch (samples)  = 16 = ") for line in lines)
    assert (out / "config.json").is_file()
