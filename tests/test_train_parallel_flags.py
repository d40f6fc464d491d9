"""``trainer-ext train``'s parallel sizes: flags and config keys, the ParallelismConfig they give the job, refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainer_ext.errors import ConfigError
from trainer_ext.job.arguments import TrainJobArguments
from trainer_ext.job.flags import parse_train_args, parse_train_values
from trainer_ext.job.parallel import check_tp_config, fitted, parallelism_from_sizes


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
        (["--cp_size", "2"], "context parallelism is not supported yet"),
        (["--task", "causal-lm", "--tp_size", "2"], "but the job has 1"),  # one process, not launched
        (["--tp_size", "0"], "tp_size must be at least 1"),
        (["--tp_size", "two"], "--tp_size takes a whole number"),
    ],
    ids=["cp", "world", "zero", "word"],
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
