"""A job's data under hostile input: a data path that is not a regular file is named as what it is (never opened),
a bad JSON line, a row without text and an absurd label id are each one ConfigError naming the file and the row."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from trainer_ext.errors import ConfigError
from trainer_ext.job.arguments import job_arguments_from_dict
from trainer_ext.job.run import label_names, load_raw_datasets

ROOT = Path(__file__).resolve().parents[1]


def _args(tmp_path: Path, **values: object):
    fields = dict(
        task="sequence-classification",
        output_dir=str(tmp_path / "out"),
        validation_split_percentage=0,
        report_to="none",
    )
    fields.update(values)
    return job_arguments_from_dict(fields)


def _load(tmp_path: Path, text: str, name: str = "data.jsonl", **values: object) -> datasets.DatasetDict:
    path = tmp_path / name
    path.write_text(text)
    return load_raw_datasets(_args(tmp_path, train_file=str(path), **values))


def _refused(tmp_path: Path, text: str, name: str = "data.jsonl", **values: object) -> str:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, text, name, **values)
    said = str(caught.value)
    assert "\n" not in said
    return said


# a data path that is not a regular file


def _make(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    elif kind == "dangling":
        path.symlink_to(path.parent / "gone.jsonl")


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("fifo", "is a FIFO (named pipe), not a regular file"),
        ("zero", "is a device, not a regular file"),
        ("folder", "is a folder; give one data file in it"),
        ("dangling", "a link to nothing"),
    ],
)
@pytest.mark.parametrize("flag", ["train_file", "validation_file"])
def test_a_data_path_that_is_not_a_regular_file_is_named_as_what_it_is(tmp_path, kind, message, flag):
    """Before, each was 'no such file'. Checked with stat only: the FIFO is never opened (no writer: it would hang)."""
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n')
    odd = tmp_path / "odd.jsonl"
    _make(kind, odd)
    values = {"train_file": str(good), flag: str(odd)}
    with pytest.raises(ConfigError) as caught:
        _args(tmp_path, **values)
    assert f"--{flag} '{odd}'" in str(caught.value) and message in str(caught.value)


@pytest.mark.timeout(300)
def test_the_cli_names_a_fifo_train_file_in_one_line_without_opening_it(tmp_path):
    """In a child process with a time limit: a FIFO opened for reading with no writer would block forever."""
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "trainer_ext", "train", "--train_file", str(fifo), "--output_dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("train blocked on a FIFO given as --train_file")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is a FIFO" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# a bad JSON line


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n{"text": oops}\n', "line 3: Expecting value"),
        ('{"text": "a", "label": 0}\n\n{"text": "b", "label": 1\n', "line 3: Expecting ',' delimiter"),
        ('{"text": "a", "label": 0}\n[1, 2]\n', "line 2: a JSON Lines row must be an object"),
    ],
)
def test_a_bad_json_line_is_named(tmp_path, text, message):
    said = _refused(tmp_path, text)
    assert f"'{tmp_path / 'data.jsonl'}': {message}" in said


def test_a_bad_line_in_the_validation_file_is_named(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n')
    (tmp_path / "valid.jsonl").write_text('{"text": "a", "label": 0}\n{"text": "b", "label": }\n')
    args = _args(tmp_path, train_file=str(tmp_path / "train.jsonl"), validation_file=str(tmp_path / "valid.jsonl"))
    with pytest.raises(ConfigError, match=r"valid\.jsonl': line 2: Expecting value"):
        load_raw_datasets(args)


def test_a_json_document_that_does_not_parse_names_its_line(tmp_path):
    said = _refused(tmp_path, '[\n {"text": "a", "label": 0},\n {"text": "b" "label": 1}\n]\n', name="data.json")
    assert "line 3 column" in said


# rows without text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"text": "a", "label": 0}\n{"text": null, "label": 1}\n', "row 2 of '{}' has no value in the text column"),
        ('{"text": "a", "label": 0}\n{"label": 1}\n', "row 2 of '{}' has no value in the text column"),
        ('{"text": "a", "label": 0}\n{"text": 5, "label": 1}\n', "row 2 of '{}' has int 5 in the text column"),
        ('{"text": 1.5, "label": 0}\n{"text": "b", "label": 1}\n', "row 1 of '{}' has float 1.5 in the text column"),
        (
            '{"text": ["a"], "label": 0}\n{"text": "b", "label": 1}\n',
            "row 1 of '{}' has list ['a'] in the text column",
        ),
    ],
)
def test_a_row_without_text_is_named(tmp_path, text, message):
    """Before, a TypeError from deep inside the tokenizer."""
    said = _refused(tmp_path, text)
    assert message.format(tmp_path / "data.jsonl") in said


def test_a_csv_row_without_text_is_named(tmp_path):
    said = _refused(tmp_path, "text,label\na,0\n,1\nc,1\n", name="data.csv")
    assert f"row 2 of '{tmp_path / 'data.csv'}' has no value in the text column 'text'" in said


def test_a_causal_lm_row_without_text_is_named(tmp_path):
    said = _refused(tmp_path, '{"text": "a b c"}\n{"text": 7}\n', task="causal-lm")
    assert "row 2 of" in said and "int 7 in the text column 'text'" in said


def test_a_held_out_split_still_names_the_file_row(tmp_path):
    """The rows are checked before the validation rows are held out (and shuffled)."""
    rows = "".join(f'{{"text": "t{i}", "label": {i % 2}}}\n' for i in range(40)) + '{"text": null, "label": 0}\n'
    said = _refused(tmp_path, rows, validation_split_percentage=20)
    assert "row 41 of" in said


# labels


@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("100000", "row 3 of '{}': the label 100000 is far beyond the 3 distinct labels"),
        ("1000000000000", "row 3 of '{}': the label 1000000000000 is past the 1,048,576 classes"),
        ("1e300", "is past the 1,048,576 classes"),
        ("null", "row 3 of '{}' has no value in the label column 'label'"),
        ("-1", "row 3 of '{}': the label -1 is not a class"),
        ("0.5", "row 3 of '{}': the label 0.5 is not a class"),
    ],
)
def test_an_absurd_label_is_named(tmp_path, label, message):
    """Before, one id of 100,000 in a 0/1 file made the metrics allocate a 74.5 GiB matrix, 10**12 built 10**12
    names; now ids are bounded by the labels the data holds."""
    text = f'{{"text": "a", "label": 0}}\n{{"text": "b", "label": 1}}\n{{"text": "c", "label": {label}}}\n'
    said = _refused(tmp_path, text)
    assert message.format(tmp_path / "data.jsonl") in said


def test_sparse_ids_are_accepted_with_num_labels(tmp_path):
    text = '{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n{"text": "c", "label": 99}\n'
    with pytest.raises(ConfigError, match="If there really are 100 classes, pass --num_labels 100"):
        _load(tmp_path, text)
    args = _args(tmp_path, train_file=str(tmp_path / "data.jsonl"), num_labels=100)
    raw = load_raw_datasets(args)
    assert len(label_names(args, raw, "label")) == 100


def test_a_few_classes_missing_from_the_data_are_fine(tmp_path):
    """Classes 0-9 where the data holds only some: ids a few past the ones present are taken as real classes."""
    text = "".join(f'{{"text": "t{i}", "label": {i}}}\n' for i in (0, 3, 9))
    (tmp_path / "d.jsonl").write_text(text)
    args = _args(tmp_path, train_file=str(tmp_path / "d.jsonl"))
    raw = load_raw_datasets(args)
    assert label_names(args, raw, "label") == [str(i) for i in range(10)]


def test_label_names_bounds_ids_for_data_that_did_not_come_through_the_loader(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a", "label": 0}\n')
    args = _args(tmp_path, train_file=str(tmp_path / "d.jsonl"))
    raw = datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": ["a", "b", "c"], "label": [0, 1, 10**5]}))
    with pytest.raises(ConfigError, match="the label 100000 is far beyond the 3 distinct labels"):
        label_names(args, raw, "label")


def test_num_labels_past_the_limit_is_refused(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n')
    args = _args(tmp_path, train_file=str(tmp_path / "d.jsonl"), num_labels=2**20 + 1)
    raw = load_raw_datasets(args)
    with pytest.raises(ConfigError, match="--num_labels 1048577 is past the 1,048,576 classes"):
        label_names(args, raw, "label")
