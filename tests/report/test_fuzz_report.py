"""Property-based fuzzing of ``trainer-ext report``'s inputs: a run folder with a random name holding random or
hostile ``trainer_state.json``, ``trainer_ext_events.jsonl``, ``all_results.json`` and ``trainer_ext_run.json``.

Random log entries (real keys and junk, math text, numbers at and past the float limits, steps of 401 digits),
events (any kind, clock readings that are no date, another host's clock), deep nesting, raw bytes, and each file
sometimes a FIFO, a link to /dev/zero or a folder. Every input must end with exit 0, or exit 2 and exactly one
``error:`` line, never a traceback or a hang (each example is bounded by the test's timeout).

Bounded for CI: ``EXAMPLES`` examples per property (``TRAINER_EXT_FUZZ_EXAMPLES`` overrides), no deadline.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the dev extra installs hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trainer_ext.cli.main import main  # noqa: E402

EXAMPLES = int(os.environ.get("TRAINER_EXT_FUZZ_EXAMPLES", "30"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
NOW = time.time()
DEAD_PID = 4_000_000

LOG_KEYS = [
    "step",
    "loss",
    "eval_loss",
    "eval_accuracy",
    "eval_$x^$",
    "learning_rate",
    "grad_norm",
    "tokens_seen",
    "num_input_tokens_seen",
    "epoch",
    "skipped_optimizer_steps",
    "nan_guard_skipped_steps",
    "samples_per_second",
    "tokens_per_second",
    "mfu",
    "train_runtime",
]
EVENT_KEYS = ["step", "host", "pid", "resumed", "status", "world_size", "strategy", "argv", "max_steps"]

hostile_numbers = st.sampled_from(
    [1e308, -1e308, 1.7e308, 10**400, -(10**400), 1e300, -1e15, 2**63, 2**53 + 1, float("nan"), float("inf"), -0.0]
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    hostile_numbers,
    st.text(max_size=8),
    st.sampled_from(["$x$", "$\\frac{", "nan", "", "\x00"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
# mostly plottable numbers, so that most examples draw figures; now and then anything
numbers = st.one_of(st.floats(min_value=-10, max_value=10), st.integers(0, 100), hostile_numbers, values)
steps = st.one_of(st.integers(0, 60), st.integers(0, 60), hostile_numbers, values)
log_entry = st.fixed_dictionaries({"step": steps}, optional={k: numbers for k in LOG_KEYS[1:]}) | st.dictionaries(
    st.sampled_from(LOG_KEYS) | st.text(max_size=6), numbers, max_size=4
)
GOOD_LOG = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}]
# a random log, most often after two good lines, so that most examples get as far as drawing
history = st.tuples(st.sampled_from([GOOD_LOG, GOOD_LOG, []]), st.lists(log_entry, max_size=12)).map(
    lambda parts: parts[0] + parts[1]
)
state = st.fixed_dictionaries(
    {"log_history": history},
    optional={"global_step": steps, "max_steps": steps, "epoch": numbers, "best_model_checkpoint": values},
)
times = st.one_of(
    st.floats(min_value=NOW - 5000, max_value=NOW - 100),
    st.floats(min_value=NOW - 5000, max_value=NOW + 5 * 86400),
    hostile_numbers,
    values,
)
event = st.fixed_dictionaries(
    {"event": st.sampled_from(["start", "log", "save", "end", "junk"]) | values, "time": times},
    optional={
        "step": steps,
        "host": st.sampled_from([socket.gethostname(), "elsewhere"]) | values,
        "pid": st.sampled_from([DEAD_PID, 1, os.getpid()]) | values,
        "resumed": st.booleans() | values,
        "status": st.sampled_from(["finished", "stopped"]) | values,
        "world_size": numbers,
        "argv": values,
        "max_steps": steps,
    },
)
deep = st.integers(min_value=60, max_value=100_000).map(lambda n: "[" * n + "]" * n)


def _json(strategy: st.SearchStrategy, weight: int = 3) -> st.SearchStrategy[bytes]:
    """JSON of ``strategy`` (``weight`` times as likely as each other form), a value of another shape, deep
    nesting, or raw bytes."""
    dump = strategy.map(lambda v: json.dumps(v).encode("utf-8"))
    others = [values.map(lambda v: json.dumps(v).encode()), deep.map(str.encode), st.binary(max_size=40)]
    return st.one_of(*[dump] * weight, *others)


events_file = st.one_of(
    st.lists(event, max_size=15).map(lambda evs: "".join(json.dumps(e) + "\n" for e in evs).encode("utf-8")),
    st.lists(st.one_of(event.map(json.dumps), deep, st.text(max_size=20)), max_size=6).map(
        lambda lines: "\n".join(lines).encode("utf-8", errors="replace")
    ),
    st.binary(max_size=60),
)
# what each file is: its bytes (most often), absent, or something that is no regular file
kinds = st.sampled_from(["bytes"] * 5 + ["absent", "fifo", "dev_zero", "folder"])
folder_name = st.text(
    alphabet=st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=40
).filter(lambda name: name not in (".", "..") and len(name.encode("utf-8")) < 200)


def _place(path: Path, kind: str, data: bytes) -> None:
    if kind == "bytes":
        path.write_bytes(data)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "folder":
        path.mkdir()


def _check(code: int, err: str, argv: list[str]) -> None:
    assert "Traceback" not in err, (argv, err[-3000:])
    assert code in (0, 2), (code, argv, err[-3000:])
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err[-3000:])


@pytest.mark.timeout(900)
@SETTINGS
@given(
    name=folder_name,
    files=st.tuples(
        st.tuples(st.sampled_from(["bytes"] * 12 + ["fifo", "dev_zero", "folder"]), _json(state, weight=12)),
        st.tuples(kinds, events_file),
        st.tuples(kinds, _json(st.dictionaries(st.sampled_from(LOG_KEYS) | st.text(max_size=6), numbers, max_size=4))),
        st.tuples(kinds, _json(st.fixed_dictionaries({"job": values}))),
    ),
    partial=st.booleans(),
)
def test_report_of_a_random_run_folder(capsys, name: str, files: tuple, partial: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / name
        run.mkdir()
        names = ("trainer_state.json", "trainer_ext_events.jsonl", "all_results.json", "trainer_ext_run.json")
        for file, (kind, data) in zip(names, files, strict=True):
            _place(run / file, kind, data)
        argv = ["report", str(run), "--out", str(Path(tmp) / "out"), *(["--partial"] if partial else [])]
        code = main(argv)
        _check(code, capsys.readouterr().err, argv)


@pytest.mark.timeout(900)
@SETTINGS
@given(names=st.lists(folder_name, min_size=2, max_size=3, unique=True), history=st.lists(log_entry, max_size=8))
def test_report_comparing_runs_with_random_names(capsys, names: list[str], history: list[dict]) -> None:
    """Several runs overlay: their folder names are in the legends (a ``$`` in one is text)."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for name in names:
            run = Path(tmp) / name
            run.mkdir()
            log = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0, "eval_$m$": 0.5}, {"step": 3, "eval_$m$": 0.7}]
            (run / "trainer_state.json").write_text(json.dumps({"log_history": log + history}))
            runs.append(str(run))
        argv = ["report", *runs, "--out", str(Path(tmp) / "out")]
        code = main(argv)
        _check(code, capsys.readouterr().err, argv)
