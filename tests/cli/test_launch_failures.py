"""The launcher names the rank that failed first and how, apart from the ranks it stopped because of it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tests.helpers.ranks import child_env
from trainer_ext.cli.launch.run import describe_failures


def _failure(local_rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode, error_file="/nonexistent")
    failure.timestamp = timestamp
    return failure


def test_a_killed_rank_is_told_apart_from_the_ranks_stopped_after_it() -> None:
    lines = describe_failures({0: _failure(0, -int(signal.SIGTERM), 10), 1: _failure(1, -int(signal.SIGKILL), 10)})
    assert lines[0].startswith("rank 1 (local rank 1, pid 101) failed first: was killed by SIGKILL (9) from outside")
    assert lines[1] == "rank 0 (local rank 0, pid 100) was stopped by the launcher after rank 1 failed"


def test_the_earliest_failure_is_first_and_exit_codes_are_named() -> None:
    lines = describe_failures({0: _failure(0, 3, 12), 1: _failure(1, 1, 11), 2: _failure(2, -int(signal.SIGTERM), 12)})
    assert (
        lines[0]
        == "rank 1 (local rank 1, pid 101) failed first: ended with exit code 1; its own error is printed above"
    )
    assert "rank 0 (local rank 0, pid 100) then ended with exit code 3" in lines
    assert "rank 2 (local rank 2, pid 102) was stopped by the launcher after rank 1 failed" in lines


def test_a_crash_inside_a_rank_is_not_blamed_on_the_outside() -> None:
    """SIGSEGV (and the other signals a process raises against itself) is a crash inside the rank, e.g. native code;
    only SIGKILL is put down to the out-of-memory killer."""
    for crash in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE):
        lines = describe_failures({0: _failure(0, -int(signal.SIGTERM), 10), 1: _failure(1, -int(crash), 10)})
        assert lines[0].startswith(f"rank 1 (local rank 1, pid 101) failed first: crashed with {crash.name} ("), lines
        assert "inside the process" in lines[0] and "out-of-memory" not in lines[0] and "outside" not in lines[0]
    killed = describe_failures({1: _failure(1, -int(signal.SIGKILL), 10)})[0]
    assert "possibly the out-of-memory killer" in killed
    hup = describe_failures({1: _failure(1, -int(signal.SIGHUP), 10)})[0]
    assert "SIGHUP" in hup and "out-of-memory" not in hup


KILL_RANK_1 = """
import os, signal, time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_killed_from_outside_is_named_by_the_launcher(tmp_path: Path) -> None:
    script = tmp_path / "kill_rank_1.py"
    script.write_text(KILL_RANK_1)
    cmd = [sys.executable, "-m", "trainer_ext", "launch", "--num_processes", "2", "--cpu", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=child_env())
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert len(errors) == 1 and "rank 1" in errors[0] and "failed first: was killed by SIGKILL" in errors[0], errors
    assert "rank 0 (local rank 0" in done.stderr and "was stopped by the launcher after rank 1 failed" in done.stderr


SEGFAULT_RANK_1 = """
import ctypes, time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    ctypes.string_at(0)  # a real segmentation fault in native code
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_segfaults_is_named_as_crashed_inside(tmp_path: Path) -> None:
    script = tmp_path / "segfault_rank_1.py"
    script.write_text(SEGFAULT_RANK_1)
    cmd = [sys.executable, "-m", "trainer_ext", "launch", "--num_processes", "2", "--cpu", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=child_env())
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert len(errors) == 1 and "rank 1" in errors[0] and "failed first: crashed with SIGSEGV (11)" in errors[0]
    assert "inside the process" in errors[0] and "out-of-memory" not in errors[0], errors
