"""``trainer-ext test``: the checks in one process, and end to end on 2 ranks, passing and with a missing rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_ext.cli.main import main
from trainer_ext.cli.selftest_worker import CHECKS, diagnose, run_checks
from trainer_ext.distributed.state import DistState, Topology


def test_every_check_passes_in_one_process(capsys):
    assert run_checks(DistState(Topology(), cpu=True), timeout=5)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["PASS", name] for name, _ in CHECKS]


def test_diagnosis_names_the_ranks_that_never_arrived():
    error = RuntimeError("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 3000 ms")
    assert diagnose(error, 3).startswith("rank(s) 1, 3 never arrived within 3 s")
    assert "did not complete within 5 s" in diagnose(RuntimeError("Timed out waiting 5000ms"), 5)
    assert "another rank died" in diagnose(RuntimeError("Connection closed by peer"), 5)


def test_test_refuses_a_target_and_dry_run_shows_the_worker(gpus, capsys):
    assert main(["test", "train"]) == 2
    assert main(["test", "--num_processes", "2", "--timeout", "7", "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "-m trainer_ext.cli.selftest_worker --timeout 7" in out and "--nproc_per_node 2" in out


def _trainer_ext(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "trainer_ext", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_self_test_passes_on_two_processes(tmp_path: Path):
    proc = _trainer_ext("test", "--num_processes", "2", "--timeout", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name, _ in CHECKS:
        assert f"PASS {name}" in proc.stdout
    assert "2 process(es) on 1 machine(s), cpu, backend gloo" in proc.stdout
    assert "vs 1 process on the whole batch" in proc.stdout


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_self_test_names_a_rank_that_never_arrives():
    proc = _trainer_ext("test", "--num_processes", "2", "--timeout", "3", "--simulate_hang", "1")
    assert proc.returncode == 1
    assert "PASS all_reduce" in proc.stdout and "PASS broadcast" in proc.stdout
    assert "FAIL barrier     rank(s) 1 never arrived within 3 s" in proc.stdout
    assert "SKIP gather, training" in proc.stdout
    assert "self-test FAILED" in proc.stderr and "Traceback" not in proc.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--timeout", "abc"], "error: test: --timeout: needs a number of seconds, e.g. 30 (got 'abc')"),
        (["--timeout", "0"], "error: test: --timeout: must be a positive number of seconds (got '0')"),
        (["--timeout"], "error: test: --timeout: expected one argument"),
    ],
)
def test_a_bad_timeout_is_one_error_line(gpus, capsys, argv, message):
    assert main(["test", *argv]) == 2
    assert capsys.readouterr().err == message + "\n"
