"""Hostile and careless input to ``trainer-ext``: one ``error:`` line, exit code 2, nothing written.

Regression tests for what once gave a traceback or was silently accepted: values of the wrong shape in a config
file, a config file that is not UTF-8 or is nested thousands deep (also for ``config validate`` and
``launch --dry_run``), nonsense numbers, and refusals that happened after the output folder was written.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer_ext.cli.main import main
from trainer_ext.job.output_dir import RUN_FILE

DEEP = "a: " + "[" * 5000 + "]" * 5000 + "\n"


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, list[str], str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error:")], err


def _refused(capsys: pytest.CaptureFixture, *argv: str) -> str:
    code, errors, err = _run(capsys, *argv)
    assert code == 2, err
    assert len(errors) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ("learning_rate: {a: 1}", "learning_rate: got {'a': 1} (dict), but it takes a number"),
        (
            "per_device_train_batch_size: [4, 8]",
            "per_device_train_batch_size: got [4, 8] (list), but it takes a whole",
        ),
        ("task: [causal-lm]", "task: got ['causal-lm'] (list), but it takes a string"),
        ("train_file: [a, b]", "train_file: got ['a', 'b'] (list), but it takes a string"),
        ("report_to: [[none]]", "report_to: got [['none']] (list), but it takes a string or a list of strings"),
        ("save_steps: {a: 1}", "save_steps: got {'a': 1} (dict), but it takes a number"),
        ("num_train_epochs: .nan", "num_train_epochs: got nan, but it takes a finite number"),
        ("seed: 1.5", "seed: 1.5 in config file"),
        ("bf16: [true]", "bf16: got [True] (list), but it takes true or false"),
    ],
)
def test_a_value_of_the_wrong_shape_is_one_error_line(tmp_path: Path, capsys, config: str, words: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(config + "\n")
    out = tmp_path / "out"
    assert words in _refused(capsys, "train", "--config", str(path), "--output_dir", str(out))
    assert not out.exists()


def test_a_config_that_is_not_utf8_or_too_deep_is_refused_everywhere(tmp_path: Path, capsys) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfelearning_rate: 1\n")
    assert "cannot be read: 'utf-8' codec can't decode" in _refused(capsys, "train", "--config", str(binary))
    deep = tmp_path / "deep.yaml"
    deep.write_text(DEEP)
    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}")
    for argv in (("train", "--config", str(deep)), ("train", "--config", str(deep_json))):
        assert "nested more than 64 levels deep" in _refused(capsys, *argv), argv
    # the launcher and the validator list their problems under one heading, in their own format
    for argv in (("config", "validate", str(deep)), ("launch", "--config_file", str(deep), "--dry_run", "train")):
        code = main(list(argv))
        captured = capsys.readouterr()
        said = captured.out + captured.err
        assert code == 2 and "Traceback" not in said, said
        assert "nested more than 64 levels deep" in said, said


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--learning_rate", "inf"], "learning_rate: got inf, but it takes a finite number"),
        (["--learning_rate", "nan"], "learning_rate: got nan, but it takes a finite number"),
        (["--num_train_epochs", "-1", "--max_steps", "-1"], "--num_train_epochs must not be negative"),
        (["--num_train_epochs", "0", "--max_steps", "0"], "nothing to train: --max_steps 0 and --num_train_epochs 0"),
        (["--max_steps", "-5"], "--max_steps must be -1 (train --num_train_epochs) or more than 0, got -5"),
        (["--save_steps", "-3"], "--save_steps must be more than 0"),
        (["--eval_steps", "0"], "--eval_steps must be more than 0"),
        (["--max_seq_length", "100000000"], "--max_seq_length must be between 2 and 1048576 tokens"),
        (["--device_memory", "0GiB"], "--device_memory must be more than 0 bytes"),
    ],
)
def test_nonsense_values_are_refused_with_the_valid_range(tmp_path: Path, capsys, flags, words) -> None:
    out = tmp_path / "out"
    assert words in _refused(capsys, "train", *flags, "--output_dir", str(out))
    assert not out.exists()


def test_a_launch_config_with_absurd_process_counts_is_refused(tmp_path: Path, capsys) -> None:
    config = tmp_path / "launch.yaml"
    config.write_text("num_processes: 100000000000000000000000\n")
    assert "num_processes: 100000000000000000000000 must be between 1 and 1048576" in _refused(
        capsys, "launch", "--config_file", str(config), "--dry_run", "train"
    )
    assert "--nproc_per_node: 5000 must be between 1 and 1024" in _refused(
        capsys, "launch", "--nproc_per_node", "5000", "--dry_run", "train"
    )


QUICK = ["--max_steps", "2", "--report_plots", "false", "--run_summary", "false", "--save_strategy", "steps"]


@pytest.mark.slow
def test_refusals_after_start_up_write_nothing_and_a_correct_job_follows(tmp_path: Path, capsys) -> None:
    """A bad scheduler argument and a checkpoint of another model are refused before output_dir is touched."""
    out = tmp_path / "out"
    words = _refused(capsys, "train", *QUICK, "--lr_scheduler_kwargs", '{"bogus": 1}', "--output_dir", str(out))
    assert "unexpected keyword argument 'bogus'" in words and not out.exists()

    other = tmp_path / "other"  # a run of another model (causal LM) with a checkpoint
    assert main(["train", *QUICK, "--save_steps", "2", "--task", "causal-lm", "--output_dir", str(other)]) == 0
    capsys.readouterr()
    checkpoint = other / "checkpoint-2"
    assert (checkpoint / "COMPLETE").is_file()
    words = _refused(capsys, "train", *QUICK, "--resume_from_checkpoint", str(checkpoint), "--output_dir", str(out))
    assert "holds another model" in words
    assert not (out / RUN_FILE).exists()
    assert main(["train", *QUICK, "--output_dir", str(out)]) == 0  # the correct job is not refused


def test_an_empty_train_file_says_it_is_empty(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "out"
    said = _refused(capsys, "train", "--train_file", str(empty), "--output_dir", str(out))
    assert f"could not load data from {str(empty)!r}: {str(empty)!r} is empty (0 bytes)" in said
    assert not out.exists()


def _config_readers(path: str, out: Path) -> list[tuple[str, ...]]:
    """Every command that reads a config file the user names: train, the launcher, the validator."""
    return [
        ("train", "--config", path, "--output_dir", str(out)),
        ("launch", "--config_file", path, "--dry_run", "train"),
        ("config", "validate", path),
    ]


@pytest.mark.timeout(120)  # before the fix a FIFO blocked every reader in open() until a writer came
def test_a_config_file_that_is_not_a_regular_file_is_one_line_everywhere(tmp_path: Path, capsys) -> None:
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    long = str(tmp_path / ("a" * 300 + ".yaml"))  # ENAMETOOLONG: once a traceback from Path.exists
    cases = [
        (str(tmp_path / "fifo.yaml"), "fifo.yaml is a FIFO (named pipe), not a regular file"),
        (str(tmp_path / "zero.yaml"), "zero.yaml is a character device, not a regular file"),
        (long, "the path is too long for the file system (File name too long); use a shorter path"),
    ]
    out = tmp_path / "out"
    for path, words in cases:
        for argv in _config_readers(path, out):
            code = main(list(argv))
            captured = capsys.readouterr()
            said = captured.out + captured.err
            assert code == 2 and "Traceback" not in said, (argv, said)
            assert words in said and len([w for w in said.splitlines() if w.startswith("error:")]) == 1, said
    assert not out.exists()


def test_duplicate_keys_and_alias_bombs_are_refused_by_every_reader(tmp_path: Path, capsys) -> None:
    duplicate = tmp_path / "dup.yaml"
    duplicate.write_text("num_processes: 1\nmixed_precision: 'no'\nnum_processes: 2\n")
    bomb = tmp_path / "bomb.yaml"  # 9**7 values from 230 bytes
    bomb.write_text(
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdef", "bcdefg", strict=True))
    )
    cases = [
        (duplicate, "is not valid YAML: line 3: duplicate key 'num_processes' (first at line 1); keep one of them"),
        (bomb, "values once its YAML aliases (*name) are expanded"),
    ]
    out = tmp_path / "out"
    for path, words in cases:
        for argv in _config_readers(str(path), out):
            code = main(list(argv))
            captured = capsys.readouterr()
            said = captured.out + captured.err
            assert code == 2 and "Traceback" not in said and words in said, (argv, said)
    assert not out.exists()
