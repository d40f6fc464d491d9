"""The CPU thread policy: cores this process may use / training processes on the machine, a passive OpenMP wait,
the user's OMP_NUM_THREADS first; set by ``train`` and ``launch`` before torch loads, shown in the start-up block."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trainer_ext.callbacks.run_summary import run_summary
from trainer_ext.cli.launch import prepare
from trainer_ext.distributed import cpu_threads

CORES = cpu_threads.usable_cores()


@pytest.mark.parametrize(
    "cores, busy, local, threads",
    [
        (2, 0.0, 1, 2),  # an idle machine: every core
        (2, 0.4, 1, 2),
        (2, 1.0, 1, 1),  # another job holds one core: the other one
        (2, 4.0, 1, 1),  # a loaded machine: one thread, never none
        (2, 0.0, 2, 1),
        (2, 0.0, 3, 1),
        (16, 0.0, 2, 8),
        (16, 3.2, 2, 6),
        (16, 40.0, 4, 1),
    ],
)
def test_the_idle_cores_are_shared_among_the_local_processes(cores, busy, local, threads, monkeypatch) -> None:
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
    policy = cpu_threads.choose(local, env={}, busy=busy)
    assert policy.threads == threads
    assert policy.wait_policy == "PASSIVE"
    assert f"{cores} usable cores, {busy:.1f} busy, / {local} processes" in policy.source


def test_the_load_counts_in_proportion_to_the_usable_cores(monkeypatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    assert cpu_threads.busy_cores(4) == 1.0


def test_the_users_settings_win_and_nonsense_is_ignored() -> None:
    assert cpu_threads.choose(4, env={"OMP_NUM_THREADS": "3"}).threads == 3
    assert cpu_threads.choose(1, env={"OMP_NUM_THREADS": "3"}).source == "OMP_NUM_THREADS set"
    assert cpu_threads.choose(1, env={"OMP_WAIT_POLICY": "ACTIVE"}).wait_policy == "ACTIVE"
    assert cpu_threads.choose(1, env={"OMP_NUM_THREADS": "zero"}, busy=0).threads == CORES
    assert cpu_threads.choose(1, env={"OMP_NUM_THREADS": "-2"}, busy=0).threads == CORES


def test_applying_writes_only_what_the_user_left_unset(monkeypatch) -> None:
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda cores: 0.0)
    env: dict[str, str] = {}
    cpu_threads.apply_to_environment(2, env=env)
    assert env == {"OMP_NUM_THREADS": str(max(CORES // 2, 1)), "TRAINER_EXT_THREADS_SOURCE": "policy",
                   "OMP_WAIT_POLICY": "PASSIVE"}  # fmt: skip
    assert "default" in cpu_threads.choose(2, env=env).source
    mine = {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "ACTIVE"}
    cpu_threads.apply_to_environment(2, env=mine)
    assert mine == {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "ACTIVE"}


def test_local_processes_come_from_torchrun() -> None:
    assert cpu_threads.local_processes({}) == 1
    assert cpu_threads.local_processes({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert cpu_threads.local_processes({"LOCAL_WORLD_SIZE": "x"}) == 1


@pytest.mark.parametrize("nproc", [1, 2])
def test_launch_gives_each_process_its_share(nproc: int, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda cores: 0.0)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    _, plan, _ = prepare(["--cpu", "--num_processes", str(nproc), "train"])
    assert plan.env["OMP_NUM_THREADS"] == str(max(CORES // nproc, 1))
    assert plan.env["OMP_WAIT_POLICY"] == "PASSIVE"
    _, plan, _ = prepare(["--cpu", "--num_processes", str(nproc), "--num_cpu_threads_per_process", "3", "train"])
    assert plan.env["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    _, plan, _ = prepare(["--cpu", "--num_processes", str(nproc), "train"])
    assert "OMP_NUM_THREADS" not in plan.env  # the user's own value reaches the processes as it is


def test_a_gpu_process_gets_one_thread_as_under_torchrun(monkeypatch, tmp_path) -> None:
    from trainer_ext.cli.launch import settings as launch_settings

    monkeypatch.setattr(launch_settings, "visible_gpus", lambda: 2)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    _, plan, _ = prepare(["--num_processes", "2", "--dry_run", "train"])
    assert plan.env["OMP_NUM_THREADS"] == "1" and "OMP_WAIT_POLICY" not in plan.env


def test_the_start_up_block_names_the_threads_and_why() -> None:
    text = run_summary(
        world_size=1,
        per_device_batch=8,
        accumulation=1,
        batches_per_epoch=10,
        max_steps=10,
        precision="no",
        strategy="single",
        schedule="linear",
        threads=cpu_threads.ThreadPolicy(2, "PASSIVE", "why").describe(),
    )
    assert "  CPU threads / process   = 2, OpenMP wait policy PASSIVE (why)" in text.splitlines()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("given", [None, "1"])
def test_train_runs_with_the_policy_or_the_users_value(given: str | None, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "TRAINER_EXT_THREADS"))}
    if given:
        env["OMP_NUM_THREADS"] = given
    argv = ["train", "--max_steps", "2", "--output_dir", str(tmp_path / "out"), "--report_plots", "false"]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", *argv], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if "CPU threads / process" in x)
    if given:
        assert line.endswith("= 1, OpenMP wait policy PASSIVE (OMP_NUM_THREADS set)")
    else:  # as many as the idle cores allow (the load average decides: 1 to all of them)
        threads = int(line.split("= ")[1].split(",")[0])
        assert 1 <= threads <= CORES
        assert line.endswith(", OpenMP wait policy PASSIVE (trainer_ext's default: the idle usable cores / training "
                             "processes on this machine)")  # fmt: skip
