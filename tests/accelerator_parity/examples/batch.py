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
import sys
import time
from pathlib import Path

from tests.helpers import forked_ranks
from tests.helpers.slowness import scaled
from tests.parity_harness.runner import child_env as harness_env
from tests.parity_harness.runner import launch_ranks, result_path

from .cases import CASES, UPSTREAM
from .standins import link_into

RUNNER = "tests.accelerator_parity.examples.runner"
PRELOAD = "tests.accelerator_parity.examples.warm"
# one launch takes 2 to 10 s forked (up to ~30 s through torchrun) on 2 busy cores; more is a hang
LAUNCH_TIMEOUT_S = 120.0


def child_env(impl: str, outdir: Path) -> dict[str, str]:
    """The ranks' environment: no hub, one thread, this implementation's own caches, CPU processes."""
    return harness_env(
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


def launch(impl: str, nproc: int, script: Path, args: tuple[str, ...], record: Path, workdir: Path, env: dict) -> dict:
    """One phase: the runner on ``nproc`` ranks in ``workdir``; its status (``ok``, ``exit N``, ``timeout``)."""
    runner_args = ["--impl", impl, "--record", str(record), str(script), *args]
    # MLflow (a tracker "all" picks where it is installed) in the run's folder: mlflow-skinny's default store is a
    # SQLite database it cannot open without SQLAlchemy (stock then fails in init_trackers)
    env = {**env, "MLFLOW_TRACKING_URI": (workdir / "mlruns").resolve().as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    log_path = record.with_suffix(".log")
    timeout = scaled(LAUNCH_TIMEOUT_S)
    started = time.perf_counter()
    forked = forked_ranks.usable(env, PRELOAD)
    status = launch_ranks(RUNNER, nproc, runner_args, env, timeout, workdir, log_path, forked)
    seconds = round(time.perf_counter() - started, 1)
    return {"status": status, "seconds": seconds, "log_tail": log_path.read_text(errors="replace")[-6000:]}


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
