"""``trainer-ext train``'s parallel sizes: flags and config keys, the ParallelismConfig they give the job, refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer_ext.errors import ConfigError
from trainer_ext.job.arguments import TrainJobArguments
from trainer_ext.job.flags import parse_train_args, parse_train_values
from trainer_ext.job.parallel import TRAIN_SIZES, check_job_model, check_tp_config, fitted, parallelism_from_sizes


def test_flags_and_config_keys_give_the_sizes(tmp_path):
    values = parse_train_values(["--tp_size", "2", "--dp-shard-size", "2"])[0]
    assert (values["tp_size"], values["dp_shard_size"], values["dp_replicate_size"], values["cp_size"]) == (
        2,
        2,
        None,
        None,
    )
    config = tmp_path / "job.yaml"
    config.write_text("tp_size: 2\ndp_replicate_size: 2\n")
    values = parse_train_values(["--config", str(config), "--tp_size", "4"])[0]
    assert (values["tp_size"], values["dp_replicate_size"]) == (4, 2)  # the flag over the file


def test_sizes_all_one_leave_the_job_without_a_parallelism_config():
    args = parse_train_args(["--task", "causal-lm", "--tp_size", "1", "--dp_shard_size", "1"])
    assert args.parallelism_config is None and args.tp_size == 1


def test_the_sizes_become_the_configuration_the_job_passes():
    config = parallelism_from_sizes({"tp_size": 2, "dp_shard_size": 2, "dp_replicate_size": None, "cp_size": None})
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size) == (1, 2, 2, 1)
    assert fitted(None, 4).dp_replicate_size == 4  # nothing given on 4 processes: plain data parallelism
    with pytest.raises(ConfigError, match="but the job has 8"):
        fitted(config, 8)


def test_both_a_config_object_and_size_flags_are_refused():
    from trainer_ext.distributed.mesh.config import ParallelismConfig

    with pytest.raises(ConfigError, match="pass the sizes in one place"):
        TrainJobArguments(task="causal-lm", tp_size=2, parallelism_config=ParallelismConfig(tp_size=2))


def test_model_config_checks_name_the_number():
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    values = {"num_attention_heads": 6, "intermediate_size": 128, "vocab_size": 91}
    with pytest.raises(ConfigError, match=r"needs num_attention_heads \(6\) of X divisible by 4"):
        check_tp_config(values, plan, 4, "X")
    check_tp_config(values, plan, 2, "X")  # 6 and 128 split over 2; a vocabulary from scratch is padded
    with pytest.raises(ConfigError, match=r"needs vocab_size \(91\) of X divisible by 2"):
        check_tp_config(values, plan, 2, "X", vocab=True)
    with pytest.raises(ConfigError, match="without a tensor-parallel plan"):
        check_tp_config({"model_type": "bert"}, None, 2, "X")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        # the default job is a BERT classifier: its task is refused before its model
        (["--cp_size", "2"], "cp_size 2: context parallelism splits causal language models' sequences, and the task"),
        (["--task", "causal-lm", "--cp_size", "2"], "but the job has 1"),  # a model cp trains: the world next
        (
            ["--task", "causal-lm", "--cp_size", "2", "--model_config", "tiny-bert"],
            "the preset tiny-bert: cp_size=2: bert is not a causal language model",
        ),
        (["--task", "causal-lm", "--cp_size", "2", "--cp_backend", "ring"], "--cp_backend"),
        (["--task", "causal-lm", "--tp_size", "2"], "but the job has 1"),  # one process, not launched
        (["--tp_size", "0"], "tp_size must be at least 1"),
        (["--tp_size", "two"], "--tp_size takes a whole number"),
    ],
    ids=["cp-task", "cp-world", "cp-model", "cp-backend", "world", "zero", "word"],
)
def test_bad_sizes_are_one_line_and_exit_2(tmp_path, argv, words):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", "train", "--output_dir", str(tmp_path / "out"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


SLIDING_MISTRAL = dict(
    model_type="mistral",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=64,
    sliding_window=16,
)


def test_cp_size_and_backend_from_flags_and_config_keys(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("cp_size: 2\ncp_backend: all_gather\n")
    values = parse_train_values(["--config", str(config), "--dp-shard-size", "2"])[0]
    assert (values["cp_size"], values["cp_backend"], values["dp_shard_size"]) == (2, "all_gather", 2)
    built = parallelism_from_sizes({name: values[name] for name in TRAIN_SIZES}, values["cp_backend"])
    assert (built.cp_size, built.cp_backend, built.dp_shard_size, built.total_size) == (2, "all_gather", 2, 4)
    assert built.dp_shard_cp_dim_names == ["dp_shard", "cp"]  # FSDP2 shards over dp_shard x cp
    assert parallelism_from_sizes({"cp_size": 2}).cp_backend == "auto"  # not read from PARALLELISM_CONFIG_*
    assert fitted(built, 4).cp_backend == "all_gather"


def test_a_model_cp_would_train_wrongly_is_refused_by_the_job_before_any_process(tmp_path):
    path = tmp_path / "mistral.json"
    path.write_text(json.dumps(SLIDING_MISTRAL))
    with pytest.raises(ConfigError) as caught:
        check_job_model({"task": "causal-lm", "model_config": str(path)}, 1, 2)
    assert str(caught.value).startswith(f"--model_config {path}: cp_size=2: mistral uses sliding-window attention")
    folder = tmp_path / "qwen2"
    folder.mkdir()
    qwen2 = {**SLIDING_MISTRAL, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 0}
    (folder / "config.json").write_text(json.dumps(qwen2))
    with pytest.raises(ConfigError, match=f"--model_name_or_path {folder}: cp_size=2: qwen2 has 2 sliding-attention"):
        check_job_model({"task": "causal-lm", "model_name_or_path": str(folder)}, 1, 2)
    # without the window the same models are trained; cp_size 1 checks nothing
    path.write_text(json.dumps({**SLIDING_MISTRAL, "sliding_window": None}))
    assert check_job_model({"task": "causal-lm", "model_config": str(path)}, 1, 2) == []
    assert check_job_model({"task": "sequence-classification"}, 1, 1) == []


def test_cp_set_only_by_the_launchers_variables_reaches_the_model_check(tmp_path, monkeypatch):
    """trl#6843: a guard that read only the flags missed a cp set through the launch config (variables here)."""
    path = tmp_path / "mistral.json"
    path.write_text(json.dumps(SLIDING_MISTRAL))
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    with pytest.raises(ConfigError, match="cp_size=2: mistral uses sliding-window attention"):
        TrainJobArguments(task="causal-lm", model_config=str(path), output_dir=str(tmp_path / "out"))


def test_short_sequences_are_noted_not_refused():
    """Every sequence is padded to a multiple of 2 x cp chunks (4 ranks on 2 tokens trained the same losses as 2 ranks,
    measured), so a max_seq_length below cp_size only leaves ranks idle."""
    notes = check_job_model({"task": "causal-lm", "max_seq_length": 2}, 1, 4)
    assert notes == [
        "max_seq_length 2 with cp_size 4: each sequence is padded to 8 positions (2 chunks per rank), so 2 of the 4 "
        "context-parallel ranks hold only padding; a smaller cp_size does the same work"
    ]
    assert check_job_model({"task": "causal-lm", "max_seq_length": 4}, 1, 4) == []
