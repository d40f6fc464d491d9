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

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _facts(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def _server_env() -> dict[str, str]:
    """An environment the fork server serves whatever earlier tests changed in this process (its own)."""
    env = child_env()
    env["OMP_NUM_THREADS"] = "1"
    if forked_ranks._server is None:
        assert forked_ranks.usable(env)
    assert forked_ranks._server is not None and forked_ranks._server[0] == forked_ranks.DEFAULT_PRELOAD
    env = dict(forked_ranks._server[1])
    assert forked_ranks.usable(env)
    return env


@pytest.mark.parametrize("nproc", [1, 3])
def test_a_forked_rank_sees_what_a_torchrun_rank_sees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nproc: int
) -> None:
    forked, launched = tmp_path / "forked", tmp_path / "torchrun"
    for out in (forked, launched):
        out.mkdir()
    proc = forked_ranks.run(JOB, nproc, [str(forked), "-", "an argument"], _server_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setenv(forked_ranks.FORCE_TORCHRUN, "1")
    run_ranks(JOB, nproc, str(launched), "-", "an argument")
    got, want = _facts(forked, nproc), _facts(launched, nproc)
    for facts in want:
        facts["argv"][0] = str(forked)
    assert got == want
    assert [f["state"][:3] for f in got] == [[rank, nproc, rank] for rank in range(nproc)]
    assert {f["sum"] for f in got} == {float(nproc)}, "one gloo group over every rank"
    assert all(f["has_port"] and f["has_run_id"] and f["argv"] == [str(forked), "-", "an argument"] for f in got)
    assert proc.stdout.splitlines() == [f"rank {rank} done" for rank in range(nproc)], "each rank's output, in order"


def test_run_ranks_forks_and_a_rank_that_raises_fails_the_launch_with_its_traceback(tmp_path: Path) -> None:
    _server_env()
    with pytest.raises(AssertionError) as failed:
        run_ranks(JOB, 2, str(tmp_path), "fail")
    assert "2-rank run of tests.helpers.launch_facts_job failed (exit 1)" in str(failed.value)
    assert "RuntimeError: rank 1 fails on purpose" in str(failed.value)
    assert "forked_ranks.py" in str(failed.value), "the ranks were forked (torchrun's traceback has no such frame)"


def test_a_failing_rank_stops_its_peers_and_a_hang_times_out(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked_ranks.run(JOB, 2, [str(tmp_path), "hang"], _server_env(), timeout=8)
    assert time.monotonic() - started < 30, "the hung rank was stopped (SIGTERM, then SIGKILL)"
    assert (tmp_path / "rank1.json").exists(), "the other rank had finished"
