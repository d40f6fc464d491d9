"""The tests' fast launch (ranks forked from a warm server) against torchrun: what a rank sees, and failures.

``run_ranks`` forks its ranks (tests/helpers/forked_ranks.py); these tests hold that to a real torchrun launch of
the same job, so a parity test that passes forked would pass under torchrun too.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import forked_ranks
from tests.helpers.ranks import child_env, run_ranks

JOB = "tests.helpers.launch_facts_job"

pytestmark = pytest.mark.distributed


def _facts(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


@pytest.mark.parametrize("nproc", [1, 3])
def test_a_forked_rank_sees_what_a_torchrun_rank_sees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nproc: int
) -> None:
    forked, launched = tmp_path / "forked", tmp_path / "torchrun"
    for out in (forked, launched):
        out.mkdir()
    proc = run_ranks(JOB, nproc, str(forked), "-", "an argument")
    assert forked_ranks._server is not None, "the fork server served this launch"
    monkeypatch.setenv(forked_ranks.FORCE_TORCHRUN, "1")
    run_ranks(JOB, nproc, str(launched), "-", "an argument")
    got, want = _facts(forked, nproc), _facts(launched, nproc)
    for facts in want:
        facts["argv"][0] = str(forked)
    assert got == want
    assert [f["state"][:3] for f in got] == [[rank, nproc, rank] for rank in range(nproc)]
    assert {f["sum"] for f in got} == {float(nproc)}, "one gloo group over every rank"
    assert all(f["has_port"] and f["has_run_id"] and f["argv"] == [str(forked), "-", "an argument"] for f in got)
    assert [line for line in proc.stdout.splitlines() if "done" in line] == [f"rank {r} done" for r in range(nproc)]


def test_a_rank_that_raises_fails_the_launch_with_its_traceback(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as failed:
        run_ranks(JOB, 2, str(tmp_path), "fail")
    assert "2-rank run of tests.helpers.launch_facts_job failed (exit 1)" in str(failed.value)
    assert "RuntimeError: rank 1 fails on purpose" in str(failed.value)


def test_a_failing_rank_stops_its_peers_and_a_hang_times_out(tmp_path: Path) -> None:
    env = child_env()
    env["OMP_NUM_THREADS"] = "1"
    assert forked_ranks.usable(env)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked_ranks.run(JOB, 2, [str(tmp_path), "hang"], env, timeout=8)
    assert time.monotonic() - started < 30, "the hung rank was stopped (SIGTERM, then SIGKILL)"
    assert (tmp_path / "rank1.json").exists(), "the other rank had finished"
