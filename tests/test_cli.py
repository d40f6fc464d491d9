"""``trainer-ext train`` parsing and error reporting: precedence, spelling, and exit code 2 for bad input."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from trainer_ext.cli.main import main
from trainer_ext.errors import ConfigError
from trainer_ext.job.flags import build_parser, parse_train_args
from trainer_ext.job.output_dir import RUN_FILE

EXAMPLES = Path(__file__).resolve().parents[1] / "configs" / "examples"


def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.fixture
def data(tmp_path):
    """A tiny classification file with string labels."""
    rows = [{"sentence": f"this is {w} {i}", "label": "pos" if i % 2 else "neg"} for i, w in enumerate("abcdefghij")]
    return write(tmp_path / "data.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def test_every_training_arguments_flag_is_accepted():
    options = {s for action in build_parser()._actions for s in action.option_strings}
    for f in dataclasses.fields(transformers.TrainingArguments):
        if f.init:
            assert f"--{f.name}" in options and f"--{f.name.replace('_', '-')}" in options


def test_dash_and_underscore_are_the_same_flag():
    a = parse_train_args(["--learning-rate", "1e-4", "--max-steps=7", "--no-remove-unused-columns"])
    b = parse_train_args(["--learning_rate", "1e-4", "--max_steps", "7", "--no_remove_unused_columns"])
    assert (a.learning_rate, a.max_steps, a.remove_unused_columns) == (1e-4, 7, False)
    assert (b.learning_rate, b.max_steps, b.remove_unused_columns) == (1e-4, 7, False)


def test_command_line_overrides_config_file_wherever_it_stands(tmp_path):
    config = write(tmp_path / "c.yaml", "learning_rate: 1e-3\nnum_train_epochs: 2\nseed: 7\n")
    after = parse_train_args(["--config", config, "--learning_rate", "5e-4"])
    before = parse_train_args(["--learning_rate", "5e-4", "--config", config])
    for args in (after, before):
        assert args.learning_rate == 5e-4  # the command line wins
        assert args.num_train_epochs == 2.0 and args.seed == 7  # the file beats the defaults
    assert isinstance(after.num_train_epochs, float)  # the YAML int went through the flag's type


def test_later_config_file_wins_and_json_works(tmp_path):
    first = write(tmp_path / "a.yaml", "seed: 1\nlogging-steps: 3\n")
    second = write(tmp_path / "b.json", json.dumps({"seed": 2}))
    args = parse_train_args(["--config", first, "--config", second])
    assert (args.seed, args.logging_steps) == (2, 3)


def test_config_values_take_yaml_types(tmp_path):
    config = write(
        tmp_path / "c.yaml",
        "report_to: [none]\nremove_unused_columns: false\nlr_scheduler_kwargs: {power: 2}\nwarmup_steps: 0.1\n",
    )
    args = parse_train_args(["--config", config])
    assert args.report_to == [] and args.remove_unused_columns is False
    assert args.lr_scheduler_kwargs == {"power": 2} and args.warmup_steps == 0.1


def test_shipped_example_configs_parse():
    for name in ("default", "causal_lm", "sequence_classification"):
        args = parse_train_args(["--config", str(EXAMPLES / f"{name}.yaml")])
        assert args.output_dir.startswith("outputs/")
    assert (
        parse_train_args(["--config", str(EXAMPLES / "default.yaml")]).fingerprint()
        == parse_train_args([]).fingerprint()
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("learning_rat: 1e-3\n", "unknown key 'learning_rat'.*Did you mean 'learning_rate'"),
        ("learning_rate: fast\n", "learning_rate: cannot read 'fast'"),
        ("num_train_epochs: 1.5\nmax_steps: 2.5\n", "max_steps: 2.5 .* not a whole number"),
        ("lr_scheduler_type: cosin\n", "not one of .*Did you mean 'cosine'"),
        ("- a\n- b\n", "must hold a mapping"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_bad_config_files(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        parse_train_args(["--config", write(tmp_path / "c.yaml", text)])


def run_main(capsys, argv):
    """Run the CLI in-process; return (exit code, stderr)."""
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--learning-rat", "1e-3"], "unknown flag --learning-rat. Did you mean --learning_rate?"),
        (["--bogus"], "unknown flag --bogus"),
        (["stray"], "unexpected argument 'stray'"),
        (["--learning_rate", "fast"], "--learning_rate takes a number, got 'fast'"),
        (["--config"], "--config needs a value"),
        (["--config", "missing.yaml"], "no such file"),
        (["--model_name_or_path", "./no/such/model"], "no such file or directory"),
        (["--model_config", "tiny-bret"], "Did you mean 'tiny-bert'"),
        (["--train_file", "missing.jsonl"], "no such file"),
        (["--train_file", "data.xlsx"], "unsupported file type"),
        pytest.param(
            ["--fp16"],
            "fp16 mixed precision needs a CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a rule for machines without CUDA"),
        ),
        (["--resume_from_checkpoint", "no/such/checkpoint-3"], "no such checkpoint directory"),
        (["--resume_from_checkpoint", "true"], "no checkpoint in"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(capsys, tmp_path, argv, message):
    out = tmp_path / "out"
    code, err = run_main(capsys, ["train", "--output_dir", str(out), *argv])
    assert code == 2
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--text_column", "text"], "--text_column 'text' is not in the data; its columns: sentence, label"),
        (["--label_column", "lable"], "Did you mean 'label'"),
        (["--task", "sequence-classification", "--num_labels", "1"], "the data has 2 classes"),
        (["--report_to", "wandbb"], "wandbb is not supported"),
    ],
)
def test_bad_input_found_after_loading_exits_2_before_anything_is_written(capsys, tmp_path, data, flags, message):
    out = tmp_path / "out"
    code, err = run_main(capsys, ["train", "--train_file", data, "--output_dir", str(out), *flags])
    assert code == 2 and message in err and "Traceback" not in err
    assert not out.exists()


def test_output_dir_holding_another_run_is_refused_and_kept(capsys, tmp_path, data):
    out = tmp_path / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / RUN_FILE).write_text(json.dumps({"job": {"task": "causal-lm"}}))
    before = sorted(p.name for p in out.rglob("*"))
    code, err = run_main(capsys, ["train", "--train_file", data, "--output_dir", str(out)])
    assert code == 2 and "holds a run of a different job" in err and "--overwrite_output_dir" in err
    assert sorted(p.name for p in out.rglob("*")) == before


def test_output_dir_with_a_foreign_model_is_refused(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"x")
    code, err = run_main(capsys, ["train", "--output_dir", str(out)])
    assert code == 2 and "not written by trainer-ext train" in err


def test_checkpoints_of_the_same_job_need_a_decision(capsys, tmp_path, data):
    out = tmp_path / "out"
    # what an earlier run of this job recorded: its columns as resolved from the data
    args = parse_train_args(["--train_file", data, "--text_column", "sentence", "--label_column", "label"])
    (out / "checkpoint-3").mkdir(parents=True)
    (out / RUN_FILE).write_text(json.dumps({"job": args.fingerprint()}))
    code, err = run_main(capsys, ["train", "--train_file", data, "--output_dir", str(out)])
    assert code == 2 and "holds checkpoints of this job (latest: checkpoint-3)" in err
    assert "--resume_from_checkpoint true" in err and "--overwrite_output_dir" in err
    code, err = run_main(
        capsys,
        [
            "train",
            "--train_file",
            data,
            "--output_dir",
            str(out),
            "--overwrite_output_dir",
            "--resume_from_checkpoint",
            "true",
        ],
    )
    assert code == 2 and "pass one of the two" in err
    assert (out / "checkpoint-3").is_dir()


def test_unknown_command_and_usage(capsys):
    assert main(["trian"]) == 2
    assert "Did you mean 'train'" in capsys.readouterr().err
    assert main([]) == 2
    assert main(["--help"]) == 0 and "train" in capsys.readouterr().out


def test_train_help_lists_flags_and_config(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--learning_rate" in out and "--config" in out and "--model_config" in out


def test_python_m_reports_bad_flag_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", "train", "--bogus", "--output_dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "error: unknown flag --bogus" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
