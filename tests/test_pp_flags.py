"""Pipeline parallelism on the command line: ``train`` and ``launch`` take ``--pp_size``, ``--pp_schedule`` and
``--pp_microbatches`` (launch also as ``--parallelism_config_pp_*`` and launch-config keys), the configuration and
``PARALLELISM_CONFIG_PP_*`` variables they give, and the refusals before any process starts (exit 2, one line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_ext.cli.launch import prepare
from trainer_ext.errors import ConfigError
from trainer_ext.job.flags import parse_train_values
from trainer_ext.job.parallel import (
    TRAIN_SIZES,
    check_job_model,
    data_parallel_ranks,
    fitted,
    parallelism_from_sizes,
    pipeline_text,
)

LLAMA = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
    vocab_size=96,
    tie_word_embeddings=False,
)


@pytest.fixture
def llama(tmp_path: Path) -> str:
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def test_train_flags_and_config_keys_give_the_pipeline(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("pp_size: 2\npp_schedule: gpipe\npp_microbatches: 8\n")
    values = parse_train_values(["--config", str(config), "--pp-schedule", "interleaved_1f1b"])[0]
    assert (values["pp_size"], values["pp_schedule"], values["pp_microbatches"]) == (2, "interleaved_1f1b", 8)
    built = parallelism_from_sizes(
        {name: values[name] for name in TRAIN_SIZES}, None, values["pp_schedule"], values["pp_microbatches"]
    )
    assert (built.pp_size, built.pp_schedule, built.pp_microbatches, built.total_size) == (2, "interleaved_1f1b", 8, 2)
    assert parallelism_from_sizes({"pp_size": 2}).pp_schedule == "1f1b"  # not read from PARALLELISM_CONFIG_*


def test_pp_alone_on_more_processes_shards_each_stage_and_counts_data_parallel_ranks():
    config = fitted(parallelism_from_sizes({"pp_size": 2}, pp_schedule="gpipe"), 8)
    assert (config.dp_shard_size, config.pp_size, config.pp_schedule) == (4, 2, "gpipe")
    assert data_parallel_ranks(config) == 4  # the two stages of one pipeline read the same batch
    with pytest.raises(ConfigError, match="but the job has 3"):
        fitted(parallelism_from_sizes({"pp_size": 2}), 3)


def test_the_pipeline_line_names_stages_schedule_microbatches_and_bubble():
    config = parallelism_from_sizes({"pp_size": 2}, pp_microbatches=4)
    assert pipeline_text(config, [(0, 4), (4, 8)]) == "2 stages (layers 0-3 | 4-7), 1f1b, 4 microbatches, bubble 20%"
    interleaved = parallelism_from_sizes({"pp_size": 2}, pp_schedule="interleaved_1f1b")
    assert pipeline_text(interleaved) == "4 stages on 2 ranks, interleaved_1f1b, 4 microbatches, bubble 11%"
    assert pipeline_text(parallelism_from_sizes({"dp_shard_size": 2})) == ""


def test_the_job_model_is_checked_against_the_pipeline_split(llama, tmp_path):
    assert check_job_model({"task": "causal-lm", "model_config": llama}, 1, 1, 2) == []
    with pytest.raises(ConfigError, match="fewer than the 8 pipeline stages"):
        check_job_model({"task": "causal-lm", "model_config": llama}, 1, 1, 8)
    tied = tmp_path / "tied.json"
    tied.write_text(json.dumps({**LLAMA, "tie_word_embeddings": True}))
    with pytest.raises(ConfigError, match=f"--model_config {tied}: pipeline of 2 stages: .* ties lm_head"):
        check_job_model({"task": "causal-lm", "model_config": str(tied)}, 1, 1, 2)
    with pytest.raises(ConfigError, match="the preset tiny-gpt2: .*gpt2.* is not a decoder the pipeline splits"):
        check_job_model({"task": "causal-lm", "model_config": "tiny-gpt2"}, 1, 1, 2)
    with pytest.raises(ConfigError, match="pp_size 2: pipeline parallelism splits causal language models"):
        check_job_model({"task": "sequence-classification"}, 1, 1, 2)


def _train(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer_ext", "train", "--output_dir", str(tmp_path / "out"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--pp_size", "2"], "pp_size 2: pipeline parallelism splits causal language models into stages"),
        (["--task", "causal-lm", "--pp_size", "2"], "the preset tiny-llama: pipeline of 2 stages"),
        (["--task", "causal-lm", "--pp_size", "2", "--pp_schedule", "zigzag"], "--pp_schedule 'zigzag'"),
        (["--task", "causal-lm", "--pp_size", "2", "--pp_microbatches", "0"], "pp_microbatches must be at least 1"),
        (["--task", "causal-lm", "--pp_size", "2", "--cp_size", "2"], "does not compose with context parallelism"),
    ],
    ids=["task", "tied-preset", "schedule", "microbatches", "with-cp"],
)
def test_train_refusals_are_one_line_and_exit_2(tmp_path, argv, words):
    proc = _train(tmp_path, *argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_launch_flags_reach_a_script_as_variables(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("print('hello')\n")
    argv = ["--num_processes", "4", "--parallelism_config_pp_size", "2", "--pp_schedule", "gpipe"]
    settings, plan, _ = prepare([*argv, "--pp-microbatches", "6", str(script)])
    assert (settings["pp_size"], settings["pp_schedule"], settings["pp_microbatches"]) == (2, "gpipe", 6)
    assert settings.sources["pp_size"] == "command line --parallelism_config_pp_size"
    env = {k.removeprefix("PARALLELISM_CONFIG_"): v for k, v in plan.env.items() if k.startswith("PARALLELISM_")}
    assert (env["PP_SIZE"], env["DP_SHARD_SIZE"], env["PP_SCHEDULE"], env["PP_MICROBATCHES"]) == (
        "2",
        "2",
        "gpipe",
        "6",
    )
    assert plan.parallel.line().startswith(
        "mesh: dp_shard 2 x pp 2 (2 data-parallel ranks; pipeline 2 stages, gpipe, 6 microbatches, bubble 14%;"
    )
    _, plain, _ = prepare(["--num_processes", "2", "--tp_size", "2", str(script)])
    assert not any("PP_" in k for k in plain.env)  # accelerate's variables only, without a pipeline


@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "parallelism_config"])
def test_launch_config_keys_pass_the_pipeline_to_train_as_flags(tmp_path, llama, nested):
    config = tmp_path / "launch.yaml"
    keys = "pp_size: 2\npp_schedule: interleaved_1f1b\npp_microbatches: 8\n"
    if nested:
        keys = "parallelism_config:\n" + "".join(f"  parallelism_config_{line}\n" for line in keys.splitlines())
    config.write_text("num_processes: 2\n" + keys)
    _, plan, _ = prepare(["--config_file", str(config), "train", "--task", "causal-lm", "--model_config", llama])
    args = plan.command[plan.command.index("train") + 1 :]
    assert args[-6:] == ["--pp_size", "2", "--pp_schedule", "interleaved_1f1b", "--pp_microbatches", "8"]
    assert plan.env["PARALLELISM_CONFIG_PP_SCHEDULE"] == "interleaved_1f1b"
    assert "pipeline 4 stages on 2 ranks, interleaved_1f1b, 8 microbatches" in plan.parallel.line()


def _launch(tmp_path: Path, *argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", "launch", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and " launch config: " not in line]
    assert "Traceback" not in proc.stderr and lines[0] == "error: cannot launch (1 problem):" and len(lines) == 2
    return lines[1]


def test_launch_refusals_are_one_line_and_exit_2(tmp_path, llama):
    causal = ["train", "--task", "causal-lm"]
    assert "the preset tiny-llama: pipeline of 2 stages" in _launch(
        tmp_path, "--num_processes", "2", "--pp_size", "2", "--dry_run", *causal
    )
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**LLAMA, "num_hidden_layers": 3}))
    zbv = ["--num_processes", "2", "--pp_size", "2", "--pp_schedule", "zbv_zero_bubble", "--dry_run"]
    assert "fewer than the 4 pipeline stages" in _launch(tmp_path, *zbv, *causal, "--model_config", str(small))
    zero2 = Path(__file__).resolve().parents[1] / "configs" / "deepspeed" / "zero2.json"
    assert "pp_size 2" in _launch(
        tmp_path, "--num_processes", "2", "--pp_size", "2", "--deepspeed", str(zero2), "--dry_run", *causal
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_processes: 2\nparallelism_config:\n  pp_schedule: zigzag\n")
    assert "parallelism_config.pp_schedule" in _launch(tmp_path, "--config_file", str(bad), "--dry_run", *causal)


def test_the_start_up_block_has_a_pipeline_line():
    from types import SimpleNamespace

    from trainer_ext.callbacks.run_summary import _pipeline, run_summary

    config = parallelism_from_sizes({"pp_size": 2}, pp_microbatches=4)
    model = SimpleNamespace(_trainer_ext_pipeline=SimpleNamespace(ranges=[(0, 4), (4, 8)]))
    line = _pipeline(SimpleNamespace(parallelism_config=config), model)
    assert line == pipeline_text(config, [(0, 4), (4, 8)])
    assert _pipeline(SimpleNamespace(parallelism_config=parallelism_from_sizes({"tp_size": 2})), model) is None
    block = run_summary(
        world_size=2,
        per_device_batch=8,
        accumulation=1,
        batches_per_epoch=10,
        max_steps=10,
        precision="no",
        strategy="pipeline",
        schedule="linear",
        mesh="pp 2",
        data_parallel=1,
        pipeline=line,
    )
    assert "  pipeline parallel       = 2 stages (layers 0-3 | 4-7), 1f1b, 4 microbatches, bubble 20%" in block
    assert "the ranks of one pipeline share a batch" in block
