"""Run one scenario under one implementation on N CPU processes (every phase); write what the ranks observed.

    python -m tests.accelerator_parity.run --scenario plain --nproc 2 --impl stock --out x.json
    python -m tests.accelerator_parity.run --impl ours --batch plain:1 plain:2 --outdir DIR

(from the repository root, in an environment with accelerate: /tmp/acc-venv). Each phase is one launch of
``torch.distributed.run --standalone`` (gloo on loopback, a free port); rank 0's tensors go beside the JSON in
``x.files/PHASE/``, referred to relatively from it. ``--batch`` runs several cases of one implementation, each rank
forked from a server that imported it once (``warm.py``, :mod:`tests.helpers.forked_ranks`) instead of started by
torchrun: the same launcher variables and the same worker, without paying the imports for every launch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.helpers import forked_ranks
from tests.parity_harness.runner import ROOT, child_env, launch_ranks, result_path
from tests.parity_harness.workload import versions

from .registry import ALL_NPROCS, IMPLS, SCENARIOS

# A phase takes 4 to 18 s (two runs side by side on 2 cores), up to ~50 s while CI's other steps share the cores;
# more is a hang. The one phase known to hang (stock's join_uneven_inputs on CPU) is cut short instead: every line of
# it may differ (compare.py allows it), so it runs only long enough to show the hang.
PHASE_TIMEOUT_S = float(os.environ.get("ACCELERATOR_PARITY_TIMEOUT", "180"))
KNOWN_HANG_S = 15.0
KNOWN_HANGS = {("join_uneven_inputs", "dataloader_config", "stock")}  # accelerate's Join does nothing on CPU


WORKER = "tests.accelerator_parity.worker"
PRELOAD = "tests.accelerator_parity.warm"  # what a batch's fork server imports
IMPL_VAR = "ACCELERATOR_PARITY_IMPL"  # the fork server's implementation (read by warm.py)
PACKAGES = ("torch", "transformers", "accelerate", "trainer_ext", "tensorboard")  # their versions go in the result
_served: str | None = None  # the implementation this process's fork server imported (serve)


def launch(impl: str, scenario: str, phase: str, nproc: int, workdir: Path, outdir: Path, timeout: float) -> dict:
    """One phase on ``nproc`` ranks: its status (``ok``, ``exit N``, ``timeout``), each rank's record, the log tail.

    A phase past ``timeout`` gets SIGTERM: torchrun passes it on to the ranks (forked ranks get it directly), which
    print their stacks first (the log tail then shows where each one hung), then SIGKILL for whatever is left.
    Under ``serve(impl)`` the ranks are forked from the batch's server; otherwise torchrun starts them.
    """
    worker_args = [
        "--impl", impl, "--scenario", scenario, "--phase", phase, "--processes", str(nproc),
        "--workdir", str(workdir), "--outdir", str(outdir),
    ]  # fmt: skip
    outdir.mkdir(parents=True, exist_ok=True)
    log_path = outdir / "launcher.log"
    forked = _served == impl and forked_ranks.usable(_server_env(impl), PRELOAD)
    status = launch_ranks(WORKER, nproc, worker_args, child_env(), timeout, ROOT, log_path, forked)
    return _observed(status, nproc, outdir, log_path)


def _server_env(impl: str) -> dict[str, str]:
    return {**child_env(), IMPL_VAR: impl}


def serve(impl: str) -> None:
    """Start this process's fork server for ``impl``: every later launch of ``impl`` forks its ranks from it."""
    global _served
    if forked_ranks.usable(_server_env(impl), PRELOAD):
        _served = impl


def _observed(status: str, nproc: int, outdir: Path, log_path: Path) -> dict:
    ranks = []
    for rank in range(nproc):
        path = outdir / f"rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    return {"status": status, "ranks": ranks, "log_tail": log_path.read_text(errors="replace")[-6000:]}


def run_scenario(
    scenario: str, nproc: int, impl: str, out: Path, timeout: float = PHASE_TIMEOUT_S, keep: bool = False
) -> dict[str, Any]:
    """Every phase of ``scenario`` in one working folder; the result is written to ``out`` and returned."""
    started = time.perf_counter()
    files = out.parent / f"{out.stem}.files"
    shutil.rmtree(files, ignore_errors=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"accparity-{scenario}-{impl}-{nproc}-"))
    result: dict[str, Any] = {"scenario": scenario, "impl": impl, "nproc": nproc, "phases": {}}
    try:
        for phase in SCENARIOS[scenario].phases_for(impl):
            hangs = nproc > 1 and (scenario, phase, impl) in KNOWN_HANGS
            limit = min(timeout, KNOWN_HANG_S) if hangs else timeout
            observed = launch(impl, scenario, phase, nproc, workdir, files / phase, limit)
            if observed["status"].startswith("timeout") and not hangs:
                # seen in CI: a stock phase that takes seconds never finished on a loaded machine; a second launch
                # tells a flaky start from a real hang (a real one times out again), the log keeps both
                first = observed["log_tail"]
                observed = launch(impl, scenario, phase, nproc, workdir, files / phase, limit)
                observed["log_tail"] = f"[first launch timed out]\n{first}\n[second launch]\n{observed['log_tail']}"
            for record in filter(None, observed["ranks"]):
                record["weights"] = {k: f"{files.name}/{v}" for k, v in record.get("weights", {}).items()}
            result["phases"][phase] = observed
    finally:
        if keep:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["versions"] = versions(PACKAGES)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=list(SCENARIOS))
    parser.add_argument("--nproc", type=int, default=1, choices=ALL_NPROCS)
    parser.add_argument("--impl", required=True, choices=IMPLS)
    parser.add_argument("--out", help="the JSON result (tensors go to OUT_STEM.files/ beside it)")
    parser.add_argument("--batch", nargs="+", metavar="SCENARIO:NPROC", help="several cases, ranks forked (see above)")
    parser.add_argument("--outdir", help="--batch: where the results go (result_path's names)")
    parser.add_argument("--timeout", type=float, default=PHASE_TIMEOUT_S, help="seconds one phase may take")
    parser.add_argument("--keep", action="store_true", help="keep the working folder (checkpoints, project dirs)")
    options = parser.parse_args(argv)
    if options.batch:
        if not options.outdir:
            parser.error("--batch needs --outdir")
        return run_batch(options.impl, options.batch, Path(options.outdir), options.timeout)
    if not options.scenario or not options.out:
        parser.error("--scenario and --out are required (or --batch and --outdir)")
    result = run_scenario(
        options.scenario, options.nproc, options.impl, Path(options.out), options.timeout, options.keep
    )
    for phase, observed in result["phases"].items():
        print(f"{phase}: {observed['status']}")
    return 0


def run_batch(impl: str, cases: list[str], outdir: Path, timeout: float = PHASE_TIMEOUT_S) -> int:
    """``SCENARIO:NPROC`` cases of ``impl`` one after the other, their ranks forked from one warm server."""
    serve(impl)
    for case in cases:
        scenario, _, nproc = case.partition(":")
        run_scenario(scenario, int(nproc), impl, result_path(outdir, scenario, impl, int(nproc)), timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
