"""trainer-ext report on damaged, foreign or hand-edited run folders, and the report's duties inside a training job:
no traceback, nothing that stops training, nothing changed in the caller's matplotlib. Fast: no training here."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer_ext.checkpointing import marker
from trainer_ext.cli.main import main
from trainer_ext.report import load_run, write_report
from trainer_ext.report.callback import ReportCallback
from trainer_ext.report.summary import best_metrics, model_text, resume_text, summary_rows

DEAD_PID = 4_000_000  # above any pid_max: no such process


def _history(steps: int = 6) -> list[dict]:
    out = [{"step": s, "loss": 2.0 / s, "learning_rate": 1e-3, "grad_norm": 1.0} for s in range(1, steps + 1)]
    out += [{"step": 3, "eval_loss": 1.5, "eval_score": 1.0}, {"step": 6, "eval_loss": 1.2, "eval_score": 3.0}]
    return out


def _event(kind: str, t: float, **fields) -> dict:
    return {"event": kind, "time": t, **fields}


def make_run(folder: Path, *, history: list[dict] | None = None, events: list[dict] | None = None) -> Path:
    """A finished trainer-ext run folder, written by hand: state, job and event log."""
    folder.mkdir(parents=True, exist_ok=True)
    history = _history() if history is None else history
    state = {"global_step": 6, "max_steps": 6, "epoch": 1.0, "log_history": history}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    (folder / "trainer_ext_run.json").write_text(json.dumps({"job": {"task": "clm", "dataset_name": "d"}}))
    now = time.time() - 100
    if events is None:
        start = {"step": 0, "resumed": False, "max_steps": 6, "world_size": 1, "host": socket.gethostname()}
        events = [_event("start", now, pid=DEAD_PID, **start)]
        events += [_event("log", now + s, step=s) for s in range(1, 7)]
        events += [_event("end", now + 7, step=6, status="finished")]
    (folder / "trainer_ext_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def _report(capsys, *args: str) -> tuple[int, list[str]]:
    """The CLI in-process: an exception other than the one-line ConfigError escapes and fails the test."""
    code = main(["report", *args])
    return code, capsys.readouterr().err.strip().splitlines()


# -- 3. malformed files: the bad entry skipped (exit 0), or one `error:` line (exit 2) ------------------------


def _edit(case: str, run: Path) -> None:
    state = json.loads((run / "trainer_state.json").read_text())
    events = [json.loads(line) for line in (run / "trainer_ext_events.jsonl").read_text().splitlines()]
    if case == "step_string":
        state["log_history"].insert(2, {"step": "abc", "loss": 1.0})
    elif case == "step_null":
        state["log_history"].insert(2, {"step": None, "loss": 1.0})
    elif case == "step_bool_and_float":
        state["log_history"] += [{"step": True, "loss": 1.0}, {"step": 2.5, "loss": 1.0}]
    elif case == "loss_string":
        state["log_history"].insert(2, {"step": 2, "loss": "nan?"})
    elif case == "max_steps_string":
        state["max_steps"] = "x"
    elif case == "global_step_string":
        state["global_step"] = "6"
    elif case == "epoch_string":
        state["epoch"] = "one"
    elif case == "event_time_string":
        events[2]["time"] = "abc"
    elif case == "event_step_string":
        events[3]["step"] = "4"
    elif case == "event_not_an_object":
        events.insert(1, ["log", 3])
    elif case == "world_size_string":
        events[0]["world_size"] = "2"
    elif case == "end_status_number":
        events[-1]["status"] = 7
    elif case == "argv_string":
        events[0]["argv"] = "trainer-ext train"
    elif case == "job_string":
        (run / "trainer_ext_run.json").write_text(json.dumps({"job": "str"}))
    elif case == "job_field_number":
        (run / "trainer_ext_run.json").write_text(json.dumps({"job": {"dataset_name": 3, "task": ["x"]}}))
    elif case == "config_list":
        (run / "config.json").write_text("[1, 2]")
    elif case == "results_strings":
        (run / "all_results.json").write_text(json.dumps({"train_runtime": "long", "eval_loss": "x"}))
    elif case == "every_step_bad":
        state["log_history"] = [{"step": "abc", "loss": 1.0}, {"step": None, "loss": 2.0}]
    (run / "trainer_state.json").write_text(json.dumps(state))
    (run / "trainer_ext_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


SKIPPED = [
    "step_string",
    "step_null",
    "step_bool_and_float",
    "loss_string",
    "max_steps_string",
    "global_step_string",
    "epoch_string",
    "event_time_string",
    "event_step_string",
    "event_not_an_object",
    "world_size_string",
    "end_status_number",
    "argv_string",
    "job_string",
    "job_field_number",
    "config_list",
    "results_strings",
]


@pytest.mark.parametrize("case", SKIPPED)
def test_a_malformed_entry_is_skipped(case: str, tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run")
    _edit(case, run)
    code, errors = _report(capsys, str(run), "--out", str(tmp_path / "out"))
    assert code == 0 and errors == [], errors
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert (tmp_path / "out" / "loss_vs_step.png").is_file() and "<img" in page


@pytest.mark.parametrize("case", ["every_step_bad", "out_in_proc", "out_under_a_file"])
def test_unusable_input_is_one_error_line(case: str, tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run")
    out = str(tmp_path / "out")
    if case == "every_step_bad":
        _edit(case, run)
    elif case == "out_in_proc":
        out = "/proc"  # exists, is a folder, refuses every file: the PNG write fails
    elif case == "out_under_a_file":
        (tmp_path / "file").write_text("x")
        out = str(tmp_path / "file" / "out")
    code, errors = _report(capsys, str(run), "--out", out)
    assert code == 2 and len(errors) == 1 and errors[0].startswith("error: "), errors
    if case == "every_step_bad":
        assert "empty log" in errors[0]
    else:
        assert "--out" in errors[0]


def test_an_unwritable_out_is_one_line_through_the_real_cli(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", "report", str(run), "--out", "/proc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr


# -- 2. which checkpoints are complete: as trainer_ext.checkpointing.marker says ------------------------------


def _checkpoint(run: Path, step: int, *, state: bool = True) -> Path:
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"0" * 64)
    if state:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": _history()}))
    return folder


def test_complete_checkpoints_are_those_with_a_valid_marker(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    marker.write_marker(_checkpoint(run, 2), world_size=1, step=2)
    damaged = _checkpoint(run, 3)
    (damaged / "COMPLETE").write_text("{not json")
    dead = _checkpoint(run, 4)
    (dead / marker.SAVING).write_text("")
    truncated = _checkpoint(run, 5)
    marker.write_marker(truncated, world_size=1, step=5)
    (truncated / "model.safetensors").write_bytes(b"0" * 10)
    _checkpoint(run, 6)  # no marker in a run whose other checkpoints have one: a save that did not finish
    loaded = load_run(run)
    assert [(c.step, c.complete) for c in loaded.checkpoints] == [
        (2, True),
        (3, False),
        (4, False),
        (5, False),
        (6, False),
    ]
    assert loaded.checkpoints[0].marker["world_size"] == 1
    assert "from checkpoint-2" in resume_text(loaded)
    assert "checkpoint-2" in dict(summary_rows(loaded))["model saved in"]


def test_a_plain_transformers_run_needs_no_marker(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    _checkpoint(run, 2)
    _checkpoint(run, 4)
    _checkpoint(run, 6, state=False)  # no trainer_state.json: not a finished save
    dead = _checkpoint(run, 8)
    (dead / marker.SAVING).write_text("")
    loaded = load_run(run)
    assert [(c.step, c.complete) for c in loaded.checkpoints] == [(2, True), (4, True), (6, False), (8, False)]
    assert "from checkpoint-4" in resume_text(loaded)


# -- 7. parameters from safetensors headers, sharded saves too ------------------------------------------------


def test_parameters_are_counted_in_single_and_sharded_saves(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    single = make_run(tmp_path / "single")
    save_file({"a": torch.zeros(1000, 500), "b": torch.zeros(500_000)}, str(single / "model.safetensors"))
    assert "1.00 M parameters" in model_text(load_run(single))

    sharded = make_run(tmp_path / "sharded")
    save_file({"a": torch.zeros(1000, 1000)}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(1000, 500)}, str(sharded / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {"total_size": 6_000_000},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "1.50 M parameters" in model_text(load_run(sharded))

    broken = make_run(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    assert "parameters" not in model_text(load_run(broken))  # unreadable: left out, no error


# -- 8. "best" follows the run's own metric_for_best_model / greater_is_better ----------------------------------


@pytest.mark.parametrize(
    ("recorded", "best"),
    [
        ({}, (3, 1.0)),  # no rule recorded: by name (eval_score is no known higher-is-better word: lower wins)
        ({"metric_for_best_model": "score", "greater_is_better": True}, (6, 3.0)),
        ({"metric_for_best_model": "eval_score"}, (6, 3.0)),  # transformers' default: higher unless *loss
        ({"metric_for_best_model": "score", "greater_is_better": False}, (3, 1.0)),
    ],
)
def test_best_uses_the_runs_metric_for_best_model(recorded: dict, best: tuple, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    events = [json.loads(line) for line in (run / "trainer_ext_events.jsonl").read_text().splitlines()]
    events[0].update(recorded)
    (run / "trainer_ext_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert best_metrics(load_run(run))["eval_score"] == best


def test_best_reads_training_args_from_the_trainer_state(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", events=[])
    state = json.loads((run / "trainer_state.json").read_text())
    state["training_args"] = {"metric_for_best_model": "score", "greater_is_better": True}
    (run / "trainer_state.json").write_text(json.dumps(state))
    assert best_metrics(load_run(run))["eval_score"] == (6, 3.0)


# -- 6. the caller's matplotlib is left as it was ------------------------------------------------------------


def test_write_report_leaves_the_backend_and_rcparams_alone(tmp_path: Path) -> None:
    import matplotlib

    run = make_run(tmp_path / "run")
    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")
        with matplotlib.rc_context({"savefig.facecolor": "red"}):
            write_report([run], tmp_path / "out")
            assert matplotlib.rcParams["savefig.facecolor"] == "red"
        assert matplotlib.get_backend().lower() == "svg"
    finally:
        matplotlib.use(before)
    assert len(list((tmp_path / "out").glob("*.png"))) >= 4


# -- 4, 5. inside a training job: a failed write warns once, training goes on ----------------------------------


class _Trainer:
    def __init__(self, output_dir: Path) -> None:
        self.args = SimpleNamespace(output_dir=str(output_dir))
        self.callback_handler = SimpleNamespace(duty=lambda kind: None)

    def is_world_process_zero(self) -> bool:
        return True


def _run_hooks(output_dir: Path) -> ReportCallback:
    trainer = _Trainer(output_dir)
    callback = ReportCallback(trainer)
    args = SimpleNamespace(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        world_size=1,
        metric_for_best_model=None,
        greater_is_better=None,
    )
    state = SimpleNamespace(log_history=[], is_world_process_zero=True, global_step=0, max_steps=3)
    callback.on_train_begin(args, state, None)
    for step in (1, 2, 3):
        state.global_step = step
        callback.on_log(args, state, None, logs={"loss": 1.0})
        callback.on_save(args, state, None)
    callback.on_train_end(args, state, None)
    return callback


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_event_log_that_cannot_be_written_warns_once(tmp_path: Path, caplog) -> None:
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.WARNING, logger="trainer_ext.report"):
        _run_hooks(tmp_path / "file" / "run")  # its parent is a file: every write fails
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "event log" in warnings[0], warnings


def test_a_full_disk_warns_once_and_training_goes_on(tmp_path: Path, caplog) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        if os.environ.get("TRAINER_EXT_REQUIRE_TMPFS") == "1":
            pytest.fail(f"cannot mount a tmpfs: {mounted.stderr.decode()}")
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run = disk / "run"
        run.mkdir()
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)  # fill the disk
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        with caplog.at_level(logging.WARNING, logger="trainer_ext.report"):
            _run_hooks(run)
        warnings = _warnings(caplog)
        assert len(warnings) == 1 and "event log" in warnings[0], warnings
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_missing_matplotlib_warns_once_and_the_tables_are_written(tmp_path: Path, caplog, monkeypatch) -> None:
    run = make_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    callback = ReportCallback(trainer := _Trainer(run))
    with caplog.at_level(logging.INFO, logger="trainer_ext.report"):
        first, second = callback._write(partial=False), callback._write(partial=False)
    del trainer
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "pip install 'matplotlib>=3.7'" in warnings[0], warnings
    assert first is not None and second is not None
    assert "No figures" in first.read_text(encoding="utf-8")
