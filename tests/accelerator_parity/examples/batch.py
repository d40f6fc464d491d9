"""Run example-script cases under one implementation, each phase one launch of the runner on N processes.

    python -m tests.accelerator_parity.examples.batch --impl stock --standins DIR --outdir OUT nlp_example:2 ...

(from the repository root, in an environment with accelerate). Results: ``OUT/CASE.IMPL.NPROC.json`` (each phase's
status, time and log tail) and the ranks' records under ``OUT/CASE.IMPL.NPROC/`` (``runner.py``). Each case runs in
its own working folder linked to the stand-ins (``standins.py``).

The ranks are forked from a server that imported the implementation once (``warm.py``,
:mod:`tests.helpers.forked_ranks`: the launcher variables torchrun sets, the same runner); with
``TRAINER_EXT_TEST_TORCHRUN=1`` (or where forking is not available) each launch is
``python -m torch.distributed.run --standalone`` instead, which costs the interpreter's start and the imports of
torch, transformers, datasets and evaluate on every rank of every launch (about 15 s a launch on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import forked_ranks
from tests.helpers.slowness import scaled

from .cases import CASES, UPSTREAM
from .standins import link_into

ROOT = Path(__file__).resolve().parents[3]
RUNNER = "tests.accelerator_parity.examples.runner"
PRELOAD = "tests.accelerator_parity.examples.warm"
# one launch takes 2 to 10 s forked (up to ~30 s through torchrun) on 2 busy cores; more is a hang
LAUNCH_TIMEOUT_S = 120.0
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(impl: str, outdir: Path) -> dict[str, str]:
    """The ranks' environment: no hub, one thread, this implementation's own caches, CPU processes."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
        HF_HOME=str(outdir / f"hf-home-{impl}"),  # datasets' and evaluate's caches: not shared with the twin batch
        # what `accelerate launch --cpu` sets: a script whose Accelerator ignores its --cpu (fsdp_plugin only) still
        # gets CPU processes from stock (else each rank trains alone on a machine without GPU); ours reads no such
        # variable (a machine without GPU is CPU processes)
        ACCELERATE_USE_CPU="1",
        EXAMPLES_IMPL=impl,
    )
    return env


def launch(impl: str, nproc: int, script: Path, args: tuple[str, ...], record: Path, workdir: Path, env: dict) -> dict:
    """One phase: the runner on ``nproc`` ranks in ``workdir``; its status (``ok``, ``exit N``, ``timeout``)."""
    runner_args = ["--impl", impl, "--record", str(record), str(script), *args]
    # MLflow (a tracker "all" picks where it is installed) in the run's folder: mlflow-skinny's default store is a
    # SQLite database it cannot open without SQLAlchemy (stock then fails in init_trackers)
    env = {**env, "MLFLOW_TRACKING_URI": (workdir / "mlruns").resolve().as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    log_path = record.with_suffix(".log")
    record.parent.mkdir(parents=True, exist_ok=True)
    timeout = scaled(LAUNCH_TIMEOUT_S)
    started = time.perf_counter()
    if forked_ranks.usable(env, PRELOAD):
        log_path.write_text("")
        try:
            code = forked_ranks.run(RUNNER, nproc, runner_args, env, timeout, cwd=workdir, log=log_path).returncode
            status = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            status = f"timeout ({timeout:.0f}s)"
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "--max_restarts=0", "-m", RUNNER, *runner_args,
        ]  # fmt: skip
        with log_path.open("w") as log:
            process = subprocess.Popen(
                command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                process.wait(timeout=timeout)
                status = "ok" if process.returncode == 0 else f"exit {process.returncode}"
            except subprocess.TimeoutExpired:
                status = f"timeout ({timeout:.0f}s)"
                process.terminate()  # torchrun passes it on; the ranks print their stacks (faulthandler)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    seconds = round(time.perf_counter() - started, 1)
    return {"status": status, "seconds": seconds, "log_tail": log_path.read_text(errors="replace")[-6000:]}


def result_path(outdir: Path, case: str, impl: str, nproc: int) -> Path:
    return outdir / f"{case}.{impl}.{nproc}.json"


def record_path(outdir: Path, case: str, impl: str, nproc: int, phase: str) -> Path:
    """Where the runner's ``--record`` points for one phase (rank N: ``PHASE.rankN.json``)."""
    return outdir / f"{case}.{impl}.{nproc}" / f"{phase}.json"


def run_case(impl: str, name: str, nproc: int, standins: Path, outdir: Path) -> dict:
    """Every phase of one case, in one fresh working folder; the summary is written and returned."""
    case = CASES[name]
    env = child_env(impl, outdir)
    workdir = outdir / "work" / f"{name}.{impl}.{nproc}"
    link_into(standins, workdir)
    started = time.perf_counter()
    phases = {}
    for phase, args in case.phases:
        record = record_path(outdir, name, impl, nproc, phase)
        phases[phase] = launch(impl, nproc, UPSTREAM / case.script, args, record, workdir, env)
    summary = {
        "case": name,
        "impl": impl,
        "nproc": nproc,
        "phases": phases,
        "seconds": round(time.perf_counter() - started, 1),
    }
    result_path(outdir, name, impl, nproc).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("stock", "ours"), required=True)
    parser.add_argument("--standins", required=True, help="the folder standins.build wrote")
    parser.add_argument("--outdir", required=True)
    parser.add_argument("cases", nargs="+", metavar="CASE:NPROC")
    options = parser.parse_args(argv)
    outdir = Path(options.outdir).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    for item in options.cases:
        name, _, nproc = item.partition(":")
        summary = run_case(options.impl, name, int(nproc), Path(options.standins).resolve(), outdir)
        statuses = ", ".join(f"{phase} {p['status']} {p['seconds']}s" for phase, p in summary["phases"].items())
        print(f"{name} {options.impl} {nproc}: {statuses}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
