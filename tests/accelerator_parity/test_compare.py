"""The comparison itself: deliberate differences are allowed narrowly, with their reasons; nothing else is."""

from __future__ import annotations

import json
from pathlib import Path

from .compare import Report, allowed
from .workload import Recorder


def _report(scenario: str, nproc: int, *lines: str) -> Report:
    report = Report(scenario, nproc, failures=list(lines))
    allowed(report)
    return report


def test_our_extra_checkpoint_files_are_allowed_and_nothing_else() -> None:
    ok = 'interrupted.ranks[0].saved_files: only in stock [], only in ours ["COMPLETE", "state.json"]'
    extra = 'interrupted.ranks[0].saved_files: only in stock [], only in ours ["COMPLETE", "rank_0.pt"]'
    missing = 'interrupted.ranks[0].saved_files: only in stock ["sampler.bin"], only in ours ["COMPLETE"]'
    report = _report("resume_accelerate_style", 2, ok, extra, missing)
    assert report.failures == [extra, missing]
    assert len(report.notes) == 1 and report.notes[0].startswith("allowed (save_state writes accelerate's files")


def test_numbers_and_other_scenarios_are_never_allowed() -> None:
    loss = "run.ranks[0].epochs[0].loss[3]: stock 2.83, ours 2.41 (rel. tolerance 1e-06)"
    topology = "run.ranks[0].topology.distributed_type: stock 'MULTI_CPU', ours 'NO'"
    assert _report("plain", 2, loss, topology).failures == [loss, topology]  # one-process rule only on 1 process
    assert _report("plain", 1, loss, topology).failures == [loss]


def test_our_own_invariants_are_never_allowed() -> None:
    line = "ours: run rank 0: accelerate was imported"
    assert _report("join_uneven_inputs", 2, line).failures == [line]  # even where every other line is allowed


def test_a_stock_teardown_failure_is_allowed_only_as_a_status_line() -> None:
    """Stock's status may differ (its gloo teardown hangs or aborts now and then); ours may not, and a stock rank that
    stopped before its last observation still fails on what it is missing."""
    hang = "full.status: stock 'timeout (180s)', ours 'ok'"
    abort = "uneven_batches.status: stock 'exit 1', ours 'ok'"
    ours_hang = "full.status: stock 'ok', ours 'timeout (180s)'"
    missing = "full.ranks[1].weights: ours has none, stock {…}"
    report = _report("resume_ours_style", 2, hang, abort, ours_hang, missing)
    assert report.failures == [ours_hang, missing]
    assert len(report.notes) == 2 and all("gloo group to interpreter teardown" in note for note in report.notes)


def test_a_record_is_on_disk_after_every_observation(tmp_path: Path) -> None:
    """What a rank observed survives it hanging later: the record is rewritten as the script goes."""
    recorder = Recorder(0, tmp_path, tmp_path / "work")
    recorder.put("first", 1)
    assert json.loads((tmp_path / "rank0.json").read_text()) == {"first": 1}
    recorder.add("steps", 2.5)
    recorder.stage("broken", lambda: 1 / 0)
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["steps"] == [2.5] and record["broken"]["error"]["type"] == "ZeroDivisionError"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json"]


def test_stream_repeats_kept_by_stock_are_allowed_only_read_by_every_rank_on_two_processes() -> None:
    ids = "read_by_every_rank.ranks[0].eval_stream[0].ids: 16 items in stock [0, 1], 13 in ours [0, 1]"
    dispatched = "dispatch.ranks[0].eval_stream[0].ids: 16 items in stock [0, 1], 13 in ours [0, 1]"
    loss = "read_by_every_rank.ranks[0].epochs[0].loss[3]: stock 2.83, ours 2.41 (rel. tolerance 1e-06)"
    report = _report("iterable_dataset", 2, ids, dispatched, loss)
    assert report.failures == [dispatched, loss]
    assert _report("iterable_dataset", 1, ids).failures == [ids]
    assert _report("plain", 2, ids).failures == [ids]
