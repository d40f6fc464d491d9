"""The comparison itself: deliberate differences are allowed narrowly, with their reasons; nothing else is."""

from __future__ import annotations

from .compare import Report, allowed


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
