"""``trainer-ext launch`` with parallel sizes: flags and launch-config keys (ours and accelerate's), the variables and
train flags the processes get, the dry run's mesh line, and every refusal before a process starts (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from trainer_ext.cli.launch import prepare
from trainer_ext.cli.launch.config_file import read_config_file
from trainer_ext.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
ZERO2 = str(ROOT / "configs" / "deepspeed" / "zero2.json")
CAUSAL = ["train", "--task", "causal-lm"]  # the tiny-llama preset: 4 heads, 2 KV heads, intermediate 128


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "job.py"
    path.write_text("print('hello')\n")
    return str(path)


def launch_cli(*argv: str) -> subprocess.CompletedProcess:
    """``trainer-ext launch`` as a user runs it: a real process, in a fresh folder (a launch that was not refused
    writes its run there, not into the repository)."""
    with tempfile.TemporaryDirectory() as folder:
        return subprocess.run(
            [sys.executable, "-m", "trainer_ext", "launch", *argv],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=folder,
        )


def one_problem(proc: subprocess.CompletedProcess) -> str:
    """The one problem of a refused launch: exit 2, one ``error:`` heading, one problem line, no traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # a launch config given with --config_file is named first (an information line, not a problem)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and " launch config: " not in line]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert lines[0] == "error: cannot launch (1 problem):" and len(lines) == 2, proc.stderr
    return lines[1].removeprefix("  - ")


def test_flags_in_both_spellings_reach_a_script_as_accelerates_variables(script):
    settings, plan, _ = prepare(
        ["--num_processes", "4", "--tp_size", "2", "--parallelism_config_dp_shard_size=2", script]
    )
    assert (settings["tp_size"], settings["dp_shard_size"]) == (2, 2)
    assert settings.sources["dp_shard_size"] == "command line --parallelism_config_dp_shard_size"
    assert plan.env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    sizes = {k.removeprefix("PARALLELISM_CONFIG_"): v for k, v in plan.env.items() if k.startswith("PARALLELISM_")}
    assert sizes == {"DP_REPLICATE_SIZE": "1", "DP_SHARD_SIZE": "2", "TP_SIZE": "2", "CP_SIZE": "1", "SP_SIZE": "1"}
    assert plan.parallel.line().startswith("mesh: dp_shard 2 x tp 2 (2 data-parallel ranks;")


def test_train_gets_the_sizes_as_flags_and_its_own_flags_win():
    _, plan, _ = prepare(["--num_processes", "4", "--tp_size", "2", "--dp_shard_size", "2", *CAUSAL])
    args = plan.command[plan.command.index("train") + 1 :]
    assert args == ["--task", "causal-lm", "--dp_shard_size", "2", "--tp_size", "2"]
    assert plan.env["PARALLELISM_CONFIG_TP_SIZE"] == "2"
    # the train arguments' own sizes win over the launch's, which are then not passed on (a note says so)
    _, plan, _ = prepare(["--num_processes", "2", "--dp_shard_size", "2", *CAUSAL, "--tp_size", "2"])
    args = plan.command[plan.command.index("train") + 1 :]
    assert args == ["--task", "causal-lm", "--tp_size", "2"]
    assert plan.env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "1" and plan.env["PARALLELISM_CONFIG_TP_SIZE"] == "2"
    assert any("not passed on: the train arguments set tp_size" in note for note in plan.notes)


def test_sizes_all_one_are_plain_data_parallelism_with_nothing_exported(script):
    _, plan, _ = prepare(["--num_processes", "4", "--tp_size", "1", "--dp_shard_size", "1", script])
    assert not any(k.startswith(("PARALLELISM_", "ACCELERATE_USE_PARALLELISM")) for k in plan.env)
    assert plan.parallel.line().startswith("mesh: dp_replicate 4 (plain data parallelism")
    _, plan, _ = prepare(["--num_processes", "2", script])  # no size given: no mesh, nothing exported
    assert plan.parallel is None and not any("PARALLELISM" in k for k in plan.env)


@pytest.mark.parametrize(
    "text",
    [
        # accelerate's launch config (`accelerate config` writes the prefixed names under parallelism_config)
        "distributed_type: MULTI_CPU\nnum_processes: 4\nparallelism_config:\n  parallelism_config_dp_replicate_size: 1\n"
        "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n  parallelism_config_cp_size: 1\n"
        "  parallelism_config_cp_comm_strategy: allgather\n",
        # ours: the bare names, at the top level or under parallelism_config
        "num_processes: 4\ntp_size: 2\ndp_shard_size: 2\n",
        "num_processes: 4\nparallelism_config:\n  tp_size: 2\n  dp_shard_size: 2\n",
    ],
    ids=["accelerate", "top-level", "section"],
)
def test_launch_config_keys_ours_and_accelerates(tmp_path, text):
    path = tmp_path / "launch.yaml"
    path.write_text(text)
    config = read_config_file(path)
    assert config.problems == []
    assert (config.values["tp_size"], config.values["dp_shard_size"]) == (2, 2)
    settings, plan, _ = prepare(["--config_file", str(path), *CAUSAL])
    assert plan.parallel.line().startswith("mesh: dp_shard 2 x tp 2 ")
    if "accelerate" in text or "parallelism_config_" in text:
        assert "accelerate key parallelism_config.parallelism_config_tp_size" in settings.sources["tp_size"]
        assert config.ignored == ["parallelism_config.parallelism_config_cp_comm_strategy"]


def test_older_accelerate_tp_config_and_bad_section_keys(tmp_path):
    path = tmp_path / "launch.yaml"
    path.write_text("num_processes: 2\ntp_config:\n  tp_size: 2\n")
    assert read_config_file(path).values["tp_size"] == 2
    path.write_text("parallelism_config:\n  parallelism_config_tp_sise: 2\n  dp_shard_size: zero\n")
    problems = read_config_file(path).problems
    assert any(
        "unknown key 'parallelism_config.parallelism_config_tp_sise'. Did you mean 'tp_size'" in p for p in problems
    )
    assert any("parallelism_config.dp_shard_size: 'zero' is not a whole number" in p for p in problems)


def test_dry_run_prints_the_mesh_and_the_variables(capsys):
    assert (
        main(["launch", "--num_processes", "4", "--tp_size", "2", "--dp_shard_size", "2", "--dry_run", *CAUSAL]) == 0
    )
    out = capsys.readouterr().out
    mesh = [line for line in out.splitlines() if line.startswith("mesh:")]
    assert mesh == [
        "mesh: dp_shard 2 x tp 2 (2 data-parallel ranks; dp_shard_size from command line --dp_shard_size, "
        "tp_size from command line --tp_size)"
    ]
    assert "ACCELERATE_USE_PARALLELISM_CONFIG=true" in out and "PARALLELISM_CONFIG_TP_SIZE=2" in out


def test_the_dry_run_of_a_real_cli_shows_the_mesh():
    proc = launch_cli("--num_processes", "4", "--dp_replicate_size", "2", "--dp_shard_size", "2", "--dry_run", *CAUSAL)
    assert proc.returncode == 0, proc.stderr
    assert "mesh: dp_replicate 2 x dp_shard 2 (4 data-parallel ranks;" in proc.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--num_processes", "4", "--tp_size", "2", *CAUSAL],
            "ParallelismConfig spans 2 processes (dp_replicate 1 × dp_shard 1 × tp 2 × cp 1 × sp 1) but the job has 4: "
            "make the sizes multiply to 4, or launch 2 processes",
        ),
        (
            ["--num_processes", "2", "--tp_size", "2", "--deepspeed", ZERO2, *CAUSAL],
            "tp_size 2 (tp_size from command line --tp_size) with DeepSpeed: tensor parallelism runs on FSDP2 or "
            "alone; drop --deepspeed (use --dp_shard_size to shard the rest) or set tp_size 1",
        ),
        (
            ["--num_processes", "2", "--tp_size", "2", *CAUSAL, "--deepspeed", ZERO2],
            "with DeepSpeed: tensor parallelism runs on FSDP2 or alone",
        ),
        (
            ["--num_processes", "2", "--cp_size", "2", "train"],  # the default job: a BERT classifier
            "cp_size 2: context parallelism splits causal language models' sequences, and the task is "
            "sequence-classification; use --task causal-lm, or set cp_size 1 (use dp_shard_size or tp_size)",
        ),
        (
            ["--num_processes", "2", "--cp_size", "2", *CAUSAL, "--model_config", "tiny-gpt2", "--deepspeed", ZERO2],
            "cp_size 2 (cp_size from command line --cp_size) with DeepSpeed: context parallelism runs on FSDP2 or "
            "alone; drop --deepspeed (use --dp_shard_size to shard the rest) or set cp_size 1",
        ),
        (
            ["--num_processes", "2", "--cpu", "--cp_size", "2", "--cp_backend", "torch", *CAUSAL],
            "cp_backend='torch' runs torch's context_parallel, which has no cpu kernel (torch 2.13): use "
            "cp_backend='all_gather' or 'auto'",
        ),
        (
            ["--num_processes", "4", "--cp_size", "2", "--dp_shard_size", "2", *CAUSAL, "--model_config", "tiny-bert"],
            "the preset tiny-bert: cp_size=2: bert is not a causal language model",
        ),
        (
            ["--num_processes", "2", "--sp_size", "2", *CAUSAL],
            "ParallelismConfig sp_size=2: sequence (Ulysses) parallelism is not supported yet; set sp_size=1",
        ),
        (
            ["--num_processes", "4", "--tp_size", "4", *CAUSAL],
            "tensor parallelism over 4 ranks needs num_key_value_heads (2) of the preset tiny-llama divisible by 4: "
            "choose a tp_size that divides 2",
        ),
        (
            ["--num_processes", "2", "--tp_size", "2", "train"],  # the default job: tiny-bert, which has no plan
            "tp_size 2: the preset tiny-bert is a bert model without a tensor-parallel plan",
        ),
        (
            ["--num_processes", "2", "train", "--task", "causal-lm", "--tp_size", "2", "--dp_shard_size", "2"],
            "ParallelismConfig spans 4 processes",
        ),
    ],
    ids=[
        "world",
        "deepspeed",
        "train-deepspeed",
        "cp-task",
        "cp-deepspeed",
        "cp-torch-on-cpu",
        "cp-model",
        "sp",
        "kv-heads",
        "no-plan",
        "train-flags-world",
    ],
)
def test_refusals_are_one_line_and_exit_2_before_any_process(argv, message):
    assert message in one_problem(launch_cli(*argv))


def test_heads_and_intermediate_of_a_config_file_are_checked(tmp_path):
    values = dict(
        model_type="llama",
        hidden_size=96,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=6,
        intermediate_size=102,
        vocab_size=64,
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    line = one_problem(launch_cli("--num_processes", "4", "--tp_size", "4", *CAUSAL, "--model_config", str(path)))
    assert line == (
        f"tensor parallelism over 4 ranks needs num_attention_heads (6) of --model_config {path} divisible by 4: "
        "choose a tp_size that divides 6"
    )
    values.update(num_attention_heads=4, num_key_value_heads=4)
    path.write_text(json.dumps(values))
    line = one_problem(launch_cli("--num_processes", "4", "--tp_size", "4", *CAUSAL, "--model_config", str(path)))
    assert "needs intermediate_size (102)" in line and "divides 102" in line


def test_a_launch_config_with_bad_sizes_is_refused_by_config_validate_too(tmp_path):
    path = tmp_path / "launch.yaml"
    path.write_text("num_processes: 4\nparallelism_config:\n  parallelism_config_tp_size: 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", "config", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "ParallelismConfig spans 3 processes" in proc.stdout + proc.stderr


def test_a_pretrained_models_vocabulary_must_split_by_rows(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    config = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=91,
    )
    (folder / "config.json").write_text(json.dumps(config))
    line = one_problem(
        launch_cli("--num_processes", "2", "--tp_size", "2", *CAUSAL, "--model_name_or_path", str(folder))
    )
    assert line == (
        f"tensor parallelism over 2 ranks needs vocab_size (91) of --model_name_or_path {folder} divisible by 2: "
        "choose a tp_size that divides 91"
    )


def test_cp_flags_in_both_spellings_reach_a_script_as_accelerates_variables(script):
    settings, plan, _ = prepare(
        ["--cpu", "--num_processes", "4", "--parallelism_config_cp_size", "2", "--dp_shard_size", "2", script]
    )
    assert settings.sources["cp_size"] == "command line --parallelism_config_cp_size"
    sizes = {k.removeprefix("PARALLELISM_CONFIG_"): v for k, v in plan.env.items() if k.startswith("PARALLELISM_")}
    assert sizes == {
        "DP_REPLICATE_SIZE": "1",
        "DP_SHARD_SIZE": "2",
        "TP_SIZE": "1",
        "CP_SIZE": "2",
        "SP_SIZE": "1",
        "CP_BACKEND": "auto",
    }
    assert plan.env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert plan.parallel.line().startswith(
        "mesh: dp_shard 2 x cp 2 (2 data-parallel ranks; context-parallel attention all_gather (auto); "
    )
    _, plan, _ = prepare(["--cpu", "--num_processes", "2", "--cp_size", "2", "--cp_backend", "all_gather", script])
    assert plan.env["PARALLELISM_CONFIG_CP_BACKEND"] == "all_gather"
    _, plan, _ = prepare(["--cpu", "--num_processes", "2", "--parallelism_config_cp_backend=all_gather", script])
    assert plan.parallel is None and "PARALLELISM_CONFIG_CP_BACKEND" not in plan.env  # no cp: nothing to choose


def test_train_gets_cp_as_flags_and_its_own_backend_wins():
    _, plan, _ = prepare(["--cpu", "--num_processes", "2", "--cp_size", "2", "--cp_backend", "all_gather", *CAUSAL])
    args = plan.command[plan.command.index("train") + 1 :]
    assert args == ["--task", "causal-lm", "--use_cpu", "--cp_size", "2", "--cp_backend", "all_gather"]
    _, plan, _ = prepare(["--cpu", "--num_processes", "2", "--cp_size", "2", *CAUSAL, "--cp_backend", "all_gather"])
    args = plan.command[plan.command.index("train") + 1 :]
    assert args == ["--task", "causal-lm", "--cp_backend", "all_gather", "--use_cpu", "--cp_size", "2"]
    assert plan.env["PARALLELISM_CONFIG_CP_BACKEND"] == "all_gather"


@pytest.mark.parametrize(
    "text",
    [
        "num_processes: 2\ncp_size: 2\ncp_backend: all_gather\n",
        "num_processes: 2\nparallelism_config:\n  parallelism_config_cp_size: 2\n"
        "  parallelism_config_cp_backend: all_gather\n  parallelism_config_cp_comm_strategy: allgather\n",
    ],
    ids=["top-level", "accelerate"],
)
def test_cp_launch_config_keys_ours_and_accelerates(tmp_path, text):
    path = tmp_path / "launch.yaml"
    path.write_text(text)
    config = read_config_file(path)
    assert config.problems == []
    assert (config.values["cp_size"], config.values["cp_backend"]) == (2, "all_gather")
    _, plan, _ = prepare(["--config_file", str(path), "--cpu", *CAUSAL])
    assert plan.parallel.line().startswith("mesh: cp 2 (1 data-parallel rank; context-parallel attention all_gather; ")
    assert plan.command[-4:] == ["--cp_size", "2", "--cp_backend", "all_gather"]
    path.write_text(text.replace("all_gather", "ring"))
    assert any(
        "cp_backend: 'ring' is not one of auto, torch, all_gather" in p for p in read_config_file(path).problems
    )


SLIDING = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=64,
    sliding_window=16,
)


@pytest.mark.parametrize(
    ("model", "yaml", "reason"),
    [
        (
            dict(model_type="mistral"),
            "num_processes: 2\nuse_cpu: true\ncp_size: 2\n",
            "mistral uses sliding-window attention (16 tokens), which context parallelism cannot express",
        ),
        (
            dict(model_type="qwen2", use_sliding_window=True, max_window_layers=0),
            "distributed_type: MULTI_CPU\nnum_processes: 2\nparallelism_config:\n  parallelism_config_cp_size: 2\n",
            "qwen2 has 2 sliding-attention layers, which context parallelism would train with full causal attention",
        ),
    ],
    ids=["mistral-top-level", "qwen2-accelerate-section"],
)
def test_cp_from_a_launch_yaml_refuses_a_sliding_window_model_before_any_process(tmp_path, model, yaml, reason):
    """trl#6843: a guard that missed context parallelism set through the launch YAML trained such a model wrongly."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**SLIDING, **model}))
    launch = tmp_path / "launch.yaml"
    launch.write_text(yaml)
    line = one_problem(launch_cli("--config_file", str(launch), *CAUSAL, "--model_name_or_path", str(folder)))
    assert line == (
        f"--model_name_or_path {folder}: cp_size=2: {reason}; train it with cp_size=1 (use dp_shard_size or tp_size)"
    )


def test_the_dry_run_shows_the_mesh_with_cp_and_notes_idle_ranks(capsys):
    argv = ["launch", "--cpu", "--num_processes", "4", "--cp_size", "2", "--dp_shard_size", "2", "--dry_run", *CAUSAL]
    assert main([*argv, "--max_seq_length", "1"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("mesh:")] == [
        "mesh: dp_shard 2 x cp 2 (2 data-parallel ranks; context-parallel attention all_gather (auto); "
        "dp_shard_size from command line --dp_shard_size, cp_size from command line --cp_size)"
    ]
    assert "PARALLELISM_CONFIG_CP_SIZE=2" in out and "PARALLELISM_CONFIG_CP_BACKEND=auto" in out
    assert "  - max_seq_length 1 with cp_size 2: each sequence is padded to 4 positions" in out


def test_the_shipped_fsdp_cp_launch_config():
    settings, plan, _ = prepare(["--config_file", str(ROOT / "configs" / "launch" / "fsdp_cp.yaml"), *CAUSAL])
    assert (settings.world_size, settings["device"]) == (4, "cpu")
    assert plan.parallel.line().startswith(
        "mesh: dp_shard 2 x cp 2 (2 data-parallel ranks; context-parallel attention all_gather (auto); "
    )
    assert plan.command[-6:] == ["--dp_shard_size", "2", "--cp_size", "2", "--cp_backend", "auto"]


def test_the_shipped_fsdp_pp_launch_config():
    untied = [*CAUSAL, "--model_config", "tiny-llama-untied"]
    settings, plan, _ = prepare(["--config_file", str(ROOT / "configs" / "launch" / "fsdp_pp.yaml"), *untied])
    assert (settings.world_size, settings["device"]) == (4, "cpu")
    assert plan.parallel.line().startswith(
        "mesh: dp_shard 2 x pp 2 (2 data-parallel ranks; pipeline 2 stages, 1f1b, 4 microbatches, bubble 20%; "
    )
    assert plan.command[-8:] == [
        "--dp_shard_size", "2", "--pp_size", "2", "--pp_schedule", "1f1b", "--pp_microbatches", "4"
    ]  # fmt: skip
    proc = launch_cli("--config_file", str(ROOT / "configs" / "launch" / "fsdp_pp.yaml"), "--dry_run", *CAUSAL)
    assert one_problem(proc).startswith("the preset tiny-llama: pipeline of 2 stages: LlamaForCausalLM ties lm_head")
