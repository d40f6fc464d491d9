"""Run one parity scenario under one implementation; write what it observed as JSON.

    python -m tests.parity.run_scenario --impl stock|ours --scenario NAME --out FILE.json
    python -m tests.parity.run_scenario --impl ours --scenario A --scenario B --outdir DIR   (one fork each)
    python -m tests.parity.run_scenario --list

(from the repository root, or with it on PYTHONPATH: the Trainer scenario set is the package ``tests.parity``.)

``stock`` is ``transformers.Trainer``/``TrainingArguments`` (with accelerate). ``ours`` is trainer_ext's pair
with accelerate and peft hidden from the import system (``tests.parity_harness.workload``); ``ours+accelerate``
leaves both importable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from tests.parity_harness.runner import result_path
from tests.parity_harness.workload import set_up, versions

IMPLS = ("stock", "ours", "ours+accelerate")
PACKAGES = ("torch", "transformers", "accelerate", "peft", "trainer_ext", "datasets")  # their versions go in meta


def load_impl(name: str) -> Any:
    from .scenarios import Impl

    if name == "stock":
        import transformers

        return Impl("stock", transformers.Trainer, transformers.TrainingArguments)
    import trainer_ext

    return Impl(name, trainer_ext.Trainer, trainer_ext.TrainingArguments)


def load_scenarios() -> dict[str, Any]:
    """The registry (``tests.parity.scenarios``), imported here: after ``prepare`` has hidden accelerate."""
    from .scenarios import SCENARIOS

    return SCENARIOS


def normalise(value: Any, workdir: Path) -> Any:
    """Paths under the working directory become ``<WORKDIR>``; object addresses are blanked."""
    roots = sorted({str(workdir), str(workdir.resolve())}, key=len, reverse=True)
    if isinstance(value, dict):
        return {k: normalise(v, workdir) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v, workdir) for v in value]
    if isinstance(value, str):
        for root in roots:
            value = value.replace(root, "<WORKDIR>")
        return re.sub(r"0x[0-9a-fA-F]{6,}", "0x…", value)
    return value


def prepare(impl_name: str) -> tuple[Any, dict[str, Any]]:
    """Set the process up for one implementation; import it and the scenarios (before any fork)."""
    set_up(impl_name)
    registry = load_scenarios()
    import torch

    torch.set_num_threads(1)
    return load_impl(impl_name), registry


def run(impl: Any, registry: dict[str, Any], scenario: str, workdir: Path) -> dict[str, Any]:
    """One scenario in this process: what it observed (or the exception that ended it), with its metadata."""
    from .observe import error

    started = time.perf_counter()
    try:
        observed = {"result": registry[scenario](impl, workdir)}
    except Exception as exc:  # a scenario that dies outside its own stages: the exception is what it observed
        observed = {"error": error(exc)}
    observed["meta"] = meta(impl.name, scenario, started)
    return normalise(observed, workdir)


def meta(impl_name: str, scenario: str, started: float) -> dict[str, Any]:
    return {
        "impl": impl_name,
        "scenario": scenario,
        "seconds": round(time.perf_counter() - started, 2),
        "accelerate_imported": "accelerate" in sys.modules,
        "peft_imported": "peft" in sys.modules,
        "trainer_ext_imported": "trainer_ext" in sys.modules,
        "versions": versions(PACKAGES),
    }


def run_in_workdir(
    impl: Any, registry: dict[str, Any], scenario: str, out: Path | None, keep: bool, workdir: Path | None = None
) -> None:
    """Run in ``workdir`` (kept), or in a fresh temporary folder (removed unless ``keep``)."""
    temporary = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix=f"parity-{impl.name}-{scenario}-")) if temporary else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        observed = run(impl, registry, scenario, workdir)
    finally:
        if temporary and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif keep:
            print(f"kept {workdir}", file=sys.stderr)
    text = json.dumps(observed, indent=1, sort_keys=True)
    if out is None:
        print(text)
    else:
        out.write_text(text + "\n")


def run_forked(impl: Any, registry: dict[str, Any], scenario: str, out: Path, keep: bool, timeout: int) -> None:
    """One scenario in a child forked from this prepared process: its own process, without paying the imports."""
    started = time.perf_counter()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(timeout)  # a hung scenario dies of SIGALRM; the parent reports it
            run_in_workdir(impl, registry, scenario, out, keep)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status != 0 or not out.exists():
        how = (
            f"signal {os.WTERMSIG(status)}"
            if os.WIFSIGNALED(status)
            else f"status {os.waitstatus_to_exitcode(status)}"
        )
        failure = {
            "harness_error": f"the scenario's process ended with {how}",
            "meta": meta(impl.name, scenario, started),
        }
        out.write_text(json.dumps(failure, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=IMPLS)
    parser.add_argument("--scenario", action="append", default=[], help="a scenario name (repeat it for several)")
    parser.add_argument("--out", help="the JSON result of the one --scenario (default: stdout)")
    parser.add_argument(
        "--outdir",
        help="run every --scenario in its own process forked after the imports; results in OUTDIR/NAME.IMPL.json",
    )
    parser.add_argument("--timeout", type=int, default=180, help="seconds one forked scenario may take")
    parser.add_argument("--workdir", help="run the one --scenario in this folder (kept) instead of a temporary one")
    parser.add_argument("--keep", action="store_true", help="keep the temporary working folders")
    parser.add_argument("--list", action="store_true", help="print the scenario names and exit")
    options = parser.parse_args(argv)
    if options.list:
        print("\n".join(load_scenarios()))
        return 0
    if not options.impl or not options.scenario or (len(options.scenario) > 1 and not options.outdir):
        parser.error("--impl and --scenario are required; several --scenario need --outdir")
    impl, registry = prepare(options.impl)
    unknown = [name for name in options.scenario if name not in registry]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(registry)}")
    if options.outdir:
        outdir = Path(options.outdir)
        outdir.mkdir(parents=True, exist_ok=True)
        for name in options.scenario:
            run_forked(impl, registry, name, result_path(outdir, name, options.impl), options.keep, options.timeout)
    else:
        out = Path(options.out) if options.out else None
        workdir = Path(options.workdir) if options.workdir else None
        run_in_workdir(impl, registry, options.scenario[0], out, options.keep, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
