"""Property-based fuzzing of a job's data rows: JSON Lines and CSV files of random rows (text and labels of every
JSON type, missing keys, huge and negative ids, bad lines, raw bytes) through ``load_raw_datasets`` and
``label_names``, as ``trainer-ext train`` reads them.

Every file ends with the data loaded (texts all strings, a bounded list of class names) or one ConfigError line,
never another exception. Bounded for CI: ``EXAMPLES`` examples per property (``TRAINER_EXT_FUZZ_EXAMPLES``
overrides), no deadline.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the dev extra installs hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trainer_ext.errors import ConfigError  # noqa: E402
from trainer_ext.job.arguments import job_arguments_from_dict  # noqa: E402
from trainer_ext.job.builtin_data.checks import MAX_CLASSES  # noqa: E402
from trainer_ext.job.run import label_names, load_raw_datasets, resolve_columns  # noqa: E402

EXAMPLES = int(os.environ.get("TRAINER_EXT_FUZZ_EXAMPLES", "60"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(0, 3),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
values = st.one_of(scalars, st.lists(scalars, max_size=2), st.dictionaries(st.text(max_size=3), scalars, max_size=2))
good_row = st.fixed_dictionaries({"text": st.text(min_size=1, max_size=8), "label": st.integers(0, 2)})
rows = st.lists(
    st.one_of(
        good_row,
        good_row,
        st.fixed_dictionaries({}, optional={"text": values, "label": values}),
    ),
    min_size=1,
    max_size=8,
)


def _lines(drawn: list[dict], junk: bytes | None) -> bytes:
    text = "".join(json.dumps(row) + "\n" for row in drawn).encode()
    return text + junk if junk is not None else text


def _attempt(path: Path, task: str) -> None:
    try:
        args = job_arguments_from_dict(
            dict(task=task, train_file=str(path), output_dir=str(path.parent / "out"), validation_split_percentage=0)
        )
        raw = load_raw_datasets(args)
        text_column, label_column = resolve_columns(args, raw)
        names = label_names(args, raw, label_column) if label_column else None
    except ConfigError as error:
        assert str(error) and "\n" not in str(error), str(error)
        return
    assert all(isinstance(text, str) for text in raw["train"][text_column])
    if names is not None:
        assert 2 <= len(names) <= MAX_CLASSES


@SETTINGS
@given(
    drawn=rows,
    junk=st.one_of(st.none(), st.binary(max_size=12), st.sampled_from([b"{oops}\n", b"[1]\n", b"\xff\n"])),
    task=st.sampled_from(["sequence-classification", "causal-lm"]),
)
def test_any_json_lines_rows(drawn, junk, task):
    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / "train.jsonl"
        path.write_bytes(_lines(drawn, junk))
        _attempt(path, task)


@SETTINGS
@given(
    cells=st.lists(st.tuples(st.text(max_size=6), st.text(max_size=6)), min_size=1, max_size=8),
    task=st.sampled_from(["sequence-classification", "causal-lm"]),
)
def test_any_csv_rows(cells, task):
    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / "train.csv"
        body = "".join(f'"{a.replace(chr(34), "")}",{b.replace(",", "").replace(chr(10), "")}\n' for a, b in cells)
        path.write_text("text,label\n" + body)
        _attempt(path, task)
