"""trainer-ext report on hostile run folders (issue 39): math text in names, numbers too large to draw, clock
readings that are no date, deep JSON, FIFOs, links to /dev/zero, another host's clock, paths too long, a full disk
and very large runs. Each ends with a report drawn from the good data and a note of what was left out (exit 0), or
one ``error:`` line (exit 2); never a traceback, a hang, unbounded memory or unbounded drawing."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer_ext.cli.main import main
from trainer_ext.report import figures, write_report
from trainer_ext.report.bounds import MAX_MARKS, MAX_PANELS, MAX_POINTS, MAX_ROWS, MAX_SESSIONS

from .test_robustness import DEAD_PID, _event, make_run


def _report(capsys, run: Path, out: Path, *more: str) -> tuple[int, list[str], list[str]]:
    """The CLI in-process: (exit code, stdout lines, stderr lines); any exception but ConfigError fails the test."""
    code = main(["report", str(run), "--out", str(out), *more])
    said = capsys.readouterr()
    return code, said.out.strip().splitlines(), said.err.strip().splitlines()


def _edit_state(run: Path, change) -> None:
    state = json.loads((run / "trainer_state.json").read_text())
    change(state)
    (run / "trainer_state.json").write_text(json.dumps(state))


def _edit_events(run: Path, change) -> None:
    events = [json.loads(line) for line in (run / "trainer_ext_events.jsonl").read_text().splitlines()]
    change(events)
    (run / "trainer_ext_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _one_error(code: int, err: list[str]) -> str:
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
    return err[0]


# -- `$…$` in names is text, not math -------------------------------------------------------------------------


def test_dollar_signs_in_metric_and_folder_names_are_drawn_literally(tmp_path: Path, capsys) -> None:
    runs = [make_run(tmp_path / "a$\\frac{x$"), make_run(tmp_path / "$b^$")]  # two runs: their names are in legends
    for run in runs:
        _edit_state(
            run, lambda s: s["log_history"].extend([{"step": 3, "eval_$x^$": 1.0}, {"step": 6, "eval_$x^$": 2.0}])
        )
    code = main(["report", *map(str, runs), "--out", str(tmp_path / "out")])
    said = capsys.readouterr()
    assert code == 0 and said.err == "", said.err
    assert (tmp_path / "out" / "eval_metrics.png").is_file()


# -- values too large to draw, steps and times that are no count or date --------------------------------------

CASES = {
    "series_at_both_float_ends": lambda r: _edit_state(
        r, lambda s: s["log_history"].extend([{"step": 2, "loss": 1e308}, {"step": 3, "loss": -1e308}])
    ),
    "tokens_seen_near_the_float_limit": lambda r: _edit_state(
        r, lambda s: s["log_history"].append({"step": 4, "tokens_seen": 1.7e308})
    ),
    "step_of_401_digits": lambda r: _edit_state(r, lambda s: s["log_history"].append({"step": 10**400, "loss": 1.0})),
    "event_step_of_401_digits": lambda r: _edit_events(r, lambda e: e[3].update(step=10**400)),
    "start_time_1e300": lambda r: _edit_events(r, lambda e: e[0].update(time=1e300)),
    "start_time_before_1970": lambda r: _edit_events(r, lambda e: e[0].update(time=-1e15)),
    "end_time_1e300": lambda r: _edit_events(r, lambda e: e[-1].update(time=1e300)),
}
NOTED = {
    "series_at_both_float_ends": "2 logged values beyond ±1e+100 left out (loss)",
    "tokens_seen_near_the_float_limit": "1 logged value beyond ±1e+100 left out (tokens_seen)",
    "step_of_401_digits": "1 log entry of",
    "start_time_1e300": "1 line of",
    "start_time_before_1970": "1 line of",
    "end_time_1e300": "1 line of",
}


@pytest.mark.parametrize("case", list(CASES))
def test_values_that_cannot_be_drawn_are_left_out_and_said(case: str, tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run")
    CASES[case](run)
    code, out, err = _report(capsys, run, tmp_path / "out")
    assert code == 0 and err == [], err
    assert (tmp_path / "out" / "loss_vs_step.png").is_file()
    if case in NOTED:
        notes = [line for line in out if line.startswith("left out: ")]
        assert any(NOTED[case] in line for line in notes), out
        assert NOTED[case] in (tmp_path / "out" / "report.html").read_text(encoding="utf-8")


# -- JSON nested 100,000 deep in any file the report reads ---------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "name",
    ["trainer_ext_events.jsonl", "all_results.json", "trainer_ext_run.json", "config.json", "trainer_state.json"],
)
def test_deep_nesting_is_one_line_or_left_out(name: str, tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run")
    (run / name).write_text(DEEP + ("\n" if name.endswith("jsonl") else ""))
    code, out, err = _report(capsys, run, tmp_path / "out")
    if name == "trainer_state.json":  # the report needs it
        assert str(run / name) in _one_error(code, err) and "nested too deep" in err[0]
        return
    assert code == 0 and err == [], err
    if name != "config.json":  # the model's config only names the architecture: passed over quietly
        assert any(name in line for line in out if line.startswith("left out: ")), out


def test_a_deep_state_in_the_newest_checkpoint_is_passed_over(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run")
    checkpoint = run / "checkpoint-6"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(DEEP)
    code, out, err = _report(capsys, run, tmp_path / "out")
    assert code == 0 and err == [], err


# -- FIFOs and links to /dev/zero: not read (in a subprocess with a time and memory bound) -------------------


def _bounded_cli(run: Path, out: Path, **limits: int) -> subprocess.CompletedProcess:
    """``trainer-ext report`` in a child with 4 GiB of address space (and ``limits``): a regression that reads
    /dev/zero dies of MemoryError and one that blocks on a FIFO times out, instead of taking the machine."""

    def bound() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        if "fsize" in limits:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))

    return subprocess.run(
        [sys.executable, "-m", "trainer_ext", "report", str(run), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=bound,
    )


@pytest.mark.timeout(300)
def test_fifos_and_links_to_dev_zero_among_the_optional_files_are_left_out(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    for name in ("trainer_ext_events.jsonl", "trainer_ext_run.json"):
        (run / name).unlink()
        os.mkfifo(run / name)
    os.symlink("/dev/zero", run / "all_results.json")
    proc = _bounded_cli(run, tmp_path / "out")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    notes = [line for line in proc.stdout.splitlines() if line.startswith("left out: ")]
    assert any("trainer_ext_events.jsonl is a FIFO" in line for line in notes), proc.stdout
    assert any("trainer_ext_run.json is a FIFO" in line for line in notes), proc.stdout
    assert any("all_results.json is a device" in line for line in notes), proc.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_trainer_state_that_is_a_fifo_or_dev_zero_is_one_line(kind: str, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    state = run / "trainer_state.json"
    state.unlink()
    os.mkfifo(state) if kind == "fifo" else os.symlink("/dev/zero", state)
    proc = _bounded_cli(run, tmp_path / "out")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert str(state) in lines[0] and "not a regular file" in lines[0]


# -- another host's clock ---------------------------------------------------------------------------------------


def _other_host_run(folder: Path, offset: float) -> Path:
    """A run on another host with no end event, its events ``offset`` seconds from now."""
    now = time.time() + offset
    events = [_event("start", now - 10, step=0, resumed=False, host="elsewhere-" + socket.gethostname(), pid=DEAD_PID)]
    events += [_event("log", now - 6 + s, step=s) for s in range(1, 7)]
    return make_run(folder, events=events)


def test_a_future_time_from_another_host_is_no_sign_of_life(tmp_path: Path, capsys) -> None:
    run = _other_host_run(tmp_path / "run", offset=2 * 86400)  # its clock two days ahead: its age tells nothing
    code, _, err = _report(capsys, run, tmp_path / "out")
    assert code == 0 and err == [], err
    assert "still training" not in (tmp_path / "out" / "report.html").read_text(encoding="utf-8")


def test_another_hosts_recent_run_is_still_training(tmp_path: Path, capsys) -> None:
    run = _other_host_run(tmp_path / "run", offset=60)  # a minute of clock skew: still a sign of life
    code, _, err = _report(capsys, run, tmp_path / "out")
    assert "still training" in _one_error(code, err)


# -- paths too long for the file system ----------------------------------------------------------------------


@pytest.mark.parametrize("which", ["run", "out"])
def test_a_path_too_long_is_one_line(which: str, tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run")
    long = tmp_path / ("x" * 300)
    code, _, err = _report(capsys, long if which == "run" else run, long if which == "out" else tmp_path / "out")
    assert "File name too long" in _one_error(code, err)


def test_a_folder_named_with_line_breaks_gives_one_line(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "a\nb\rc\u2028d", history=[{"step": "x", "loss": 1.0}])  # an empty log: refused
    code, _, err = _report(capsys, run, tmp_path / "out")
    assert "empty log" in _one_error(code, err) and "a\\nb\\rc\\u2028d" in err[0]


# -- a full disk: nothing half-written, the earlier report kept ----------------------------------------------


@pytest.mark.timeout(300)
def test_a_full_disk_leaves_the_folder_as_it_was(tmp_path: Path) -> None:
    run, out = make_run(tmp_path / "run"), tmp_path / "out"
    write_report([run], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _edit_state(run, lambda s: s["log_history"].append({"step": 6, "loss": 0.5, "learning_rate": 2e-3}))
    proc = _bounded_cli(run, out, fsize=20_000)  # every PNG is larger: its write fails part way, as on a full disk
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert "cannot write the report" in lines[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no partial PNG, no temporary file


# -- very large runs: the drawing is bounded, what is left out is said ---------------------------------------


@pytest.fixture
def drawn(monkeypatch) -> dict:
    """What each saved figure holds: axes, lines, markers and the points they draw."""
    counts, save = {}, figures._save

    def count(fig, out, figure):
        lines = [line for ax in fig.axes for line in ax.lines]
        collections = [c for ax in fig.axes for c in ax.collections]
        counts[figure.name] = {
            "axes": len(fig.axes),
            "artists": len(lines) + len(collections) + sum(len(ax.texts) for ax in fig.axes),
            "points": sum(len(line.get_xdata()) for line in lines) + sum(len(c.get_offsets()) for c in collections),
        }
        return save(fig, out, figure)

    monkeypatch.setattr(figures, "_save", count)
    return counts


@pytest.mark.timeout(600)  # before the bounds this took well over 400 s: a regression fails here instead
def test_a_huge_run_is_drawn_with_bounded_work(tmp_path: Path, drawn: dict) -> None:
    steps, metrics, saves, sessions = 20_000, 3_000, 100_000, 300
    history = [
        {"step": s, "loss": 1 / s, "learning_rate": 1e-3, "grad_norm": 1.0, "tokens_seen": 10 * s}
        for s in range(1, steps + 1)
    ]
    for step in (steps // 2, steps):
        history.append({"step": step, "eval_loss": 1.0, **{f"eval_m{k}": k / step for k in range(metrics)}})
    now = time.time() - 10 * saves
    events = []
    for k in range(sessions):  # a run preempted 300 times, each session saving its share of 100,000 checkpoints
        first = k * saves // sessions
        events.append(_event("start", now + first, step=first, resumed=k > 0, host="elsewhere", pid=DEAD_PID))
        events += [_event("save", now + s + 0.5, step=s) for s in range(first + 1, (k + 1) * saves // sessions + 1)]
    run = make_run(tmp_path / "run", history=history, events=events)
    _edit_state(run, lambda s: s.update(global_step=saves, max_steps=saves))
    notes: list[str] = []
    page = write_report([run], tmp_path / "out", notes=notes)
    assert set(drawn) >= {"loss_vs_step", "loss_vs_tokens", "eval_metrics", "timeline"}
    assert drawn["eval_metrics"]["axes"] == MAX_PANELS
    runs_lines = 2 * MAX_SESSIONS + 2  # per session a line and a cross; checkpoints in one, and a legend entry
    for name, count in drawn.items():
        assert count["artists"] <= 2 * MAX_MARKS + 3 * MAX_PANELS + runs_lines + 10, (name, count)
        assert count["points"] <= 4 * MAX_POINTS + 2 * MAX_MARKS + 2 * MAX_SESSIONS, (name, count)
    assert any(f"eval metrics drawn: {MAX_PANELS} of {metrics:,} shown" in line for line in notes), notes
    assert any(f"sessions drawn on the timeline: {MAX_SESSIONS} of {sessions} shown" in line for line in notes)
    assert any(f"checkpoints listed in the events table (the newest): {MAX_ROWS} of {saves:,}" in n for n in notes)
    text = page.read_text(encoding="utf-8")
    assert text.count("<tr><td>checkpoint</td>") == MAX_ROWS and text.count("<tr><td>session ") == MAX_ROWS
    assert "Left out of this report" in text
