"""``trainer-ext train --task sft|dpo`` on bad input: exit 2, one line saying what is wrong and how to fix it, nothing
written to --output_dir; and the data-dependent refusals (columns, rows, templates) before any write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer_ext.cli.main import main

QA = [{"question": "what is 2 plus 2 ?", "answer": "4 ."}, {"question": "hi", "answer": "hello ."}]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _run(capsys: pytest.CaptureFixture[str], out: Path, argv: list[str]) -> tuple[int, str]:
    code = main(["train", "--output_dir", str(out), "--report_plots", "false", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--task", "dpo", "--packing", "true"], "--packing applies to --task sft; drop it for dpo"),
        (["--task", "causal-lm", "--packing", "true"], "--packing applies to --task sft, not causal-lm"),
        (["--task", "sft", "--chat_template", "chatlm"], "neither a built-in template (chatml, llama-3, mistral, "),
        (["--task", "sft", "--chat_template", "/no/such.jinja"], "--chat_template '/no/such.jinja': no such file"),
        (["--task", "dpo", "--metrics", "accuracy"], "a dpo job logs its rewards and accuracies itself"),
        (["--task", "dpo", "--data_format", "messages"], "pass --data_format preference or auto"),
        (["--task", "sft", "--data_format", "preference"], "--data_format preference is for --task dpo"),
        (["--task", "sft", "--beta", "0.5"], "--beta applies to --task dpo, not sft"),
        (["--task", "sft", "--loss_type", "simpo"], "--loss_type applies to --task dpo, not sft"),
        (["--task", "dpo", "--beta", "0"], "--beta must be more than 0"),
        (["--task", "dpo", "--chat_truncation", "drop"], "--chat_truncation applies to --task sft"),
        (["--task", "dpo", "--loss_type", "kto"], "sigmoid, ipo, simpo"),
        (["--task", "sft", "--chat_truncation", "middle"], "'middle' is not one of turns, drop, error, cut"),
        (["--task", "causal-lm", "--column_mapping", "text=body"], "--column_mapping applies to --task sft or dpo"),
        (["--task", "dpo", "--reference_free", "--ref_model_name_or_path", "x"], "pass one"),
        (["--task", "sft", "--column_mapping", "message=conv"], "names 'message', which no format reads"),
        (["--task", "sft", "--text_column", "body"], "--text_column applies to sequence-classification and causal-lm"),
        (["--task", "dpo", "--num_labels", "3"], "--num_labels applies to sequence-classification and causal-lm"),
        (["--task", "dpo", "--assistant_only_loss", "false"], "--assistant_only_loss applies to --task sft"),
        (["--task", "dpo", "--label_smoothing_factor", "0.1"], "--label_smoothing_factor applies to token losses"),
        (["--task", "dpo", "--simpo_gamma", "1.0"], "--simpo_gamma applies to --loss_type simpo, not sigmoid"),
    ],
)
def test_bad_chat_flags_exit_2_with_one_line_and_write_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    out = tmp_path / "out"
    code, err = _run(capsys, out, argv)
    assert code == 2, err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err  # refused before any data is read (no loading progress either)
    assert not out.exists()


def test_a_missing_column_names_the_columns_there_and_the_formats_understood(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code, err = _run(capsys, out, ["--task", "sft", "--train_file", _jsonl(tmp_path / "qa.jsonl", QA)])
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    for needed in ("columns: question, answer", "messages", "prompt-completion", "alpaca", "--column_mapping"):
        assert needed in line, line
    assert not out.exists()


def test_column_mapping_reads_the_data_under_its_own_names(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    data = _jsonl(tmp_path / "qa.jsonl", QA * 8)
    argv = ["--task", "sft", "--train_file", data, "--column_mapping", "prompt=question,completion=answer"]
    code, err = _run(capsys, out, [*argv, "--max_steps", "1", "--validation_split_percentage", "0"])
    assert code == 0, err
    assert (out / "model.safetensors").exists()


def test_a_malformed_row_is_named_and_nothing_is_written(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 4
    rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]})
    out = tmp_path / "out"
    code, err = _run(capsys, out, ["--task", "sft", "--train_file", _jsonl(tmp_path / "chat.jsonl", rows)])
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert "row 4" in line and "'bot'" in line and "roles understood" in line, line
    assert not out.exists()


def test_no_example_left_after_truncation_says_which_flag_to_change(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    long = " ".join(["word"] * 200)
    rows = [{"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "yes ."}]}] * 4
    out = tmp_path / "out"
    argv = ["--task", "sft", "--train_file", _jsonl(tmp_path / "long.jsonl", rows), "--max_seq_length", "32"]
    code, err = _run(capsys, out, [*argv, "--validation_split_percentage", "0"])
    assert code == 2, err
    assert "raise --max_seq_length" in err.strip().splitlines()[-1], err
    assert not out.exists()


def test_a_resume_is_the_same_job_only_with_the_same_data_reading(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The format read (however it was told) and the truncation are part of the job: naming the detected format
    resumes, another truncation policy is another job and is refused before anything is written."""
    out = tmp_path / "out"
    job = ["--task", "sft", "--max_train_samples", "16", "--validation_split_percentage", "0"]
    job += ["--save_strategy", "steps", "--save_steps", "1"]
    assert _run(capsys, out, [*job, "--max_steps", "1"])[0] == 0
    again = [*job, "--max_steps", "2", "--resume_from_checkpoint", "true"]
    code, err = _run(capsys, out, [*again, "--chat_truncation", "drop"])
    assert code == 2 and "chat_truncation" in err, err
    assert not (out / "checkpoint-2").exists()
    code, err = _run(capsys, out, [*again, "--data_format", "messages"])
    assert code == 0, err
    assert (out / "checkpoint-2").exists()
