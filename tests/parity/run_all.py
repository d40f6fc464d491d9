"""Run the parity scenarios under both implementations, two processes at a time, and report the differences.

    python -m tests.parity.run_all                     # every scenario
    python -m tests.parity.run_all -k resume -k files  # the scenarios whose name contains one of these
    python -m tests.parity.run_all --outdir /tmp/parity-results --ours ours+accelerate

from the repository root. Each implementation gets one process (``python -m tests.parity.run_scenario``, this
interpreter, which needs accelerate for the stock side) that imports it once and forks a child per scenario; stock
and ours run side by side. The JSON results stay in ``--outdir`` for a closer look.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .compare import compare

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 240


def scenario_names() -> list[str]:
    """The registered scenarios, read from the source (so listing them imports neither torch nor transformers)."""
    names = []
    for path in sorted(HERE.glob("scenarios_*.py")):
        tree = ast.parse(path.read_text())
        names += [
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "scenario" for d in node.decorator_list)
        ]
    return names


def run_batch(impl: str, names: list[str], outdir: Path, timeout: float | None = None) -> tuple[float, str]:
    """The scenarios under one implementation: one process imports it, then forks one child per scenario."""
    command = [sys.executable, "-m", "tests.parity.run_scenario", "--impl", impl, "--outdir", str(outdir)]
    for name in names:
        command += ["--scenario", name]
    started = time.perf_counter()
    process = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout or 60 + TIMEOUT_S * len(names),
        cwd=HERE.parent.parent,  # the repository root: `-m tests.parity.run_scenario` is found there
    )
    output = (process.stdout + process.stderr)[-6000:]
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}:\n{output}")
    return time.perf_counter() - started, output


def run_both(names: list[str], outdir: Path, ours: str = "ours") -> dict[str, dict[str, dict]]:
    """Every named scenario under stock and under ours (the two implementations side by side).

    Returns ``{name: {"stock": result, "ours": result}}``; a result that could not be read is a harness error.
    """
    outdir.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {impl: pool.submit(run_batch, impl, names, outdir) for impl in ("stock", ours)}
        failures = {}
        for impl, future in futures.items():
            try:
                future.result()
            except Exception as exc:  # reported per scenario below
                failures[impl] = str(exc)
    results: dict[str, dict[str, dict]] = {}
    for name in names:
        results[name] = {}
        for impl, side in (("stock", "stock"), (ours, "ours")):
            path = outdir / f"{name}.{impl}.json"
            if path.exists():
                results[name][side] = json.loads(path.read_text())
            else:
                results[name][side] = {"harness_error": failures.get(impl, f"no result at {path}")}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="run the scenarios whose name contains this")
    parser.add_argument("--outdir", help="where the JSON results go (default: a temporary folder, kept)")
    parser.add_argument("--ours", default="ours", choices=("ours", "ours+accelerate"))
    options = parser.parse_args(argv)
    names = [n for n in scenario_names() if not options.k or any(k in n for k in options.k)]
    outdir = Path(options.outdir or tempfile.mkdtemp(prefix="parity-results-"))
    started = time.perf_counter()
    results = run_both(names, outdir, options.ours)
    unexpected = 0
    for name in names:
        report = compare(results[name]["stock"], results[name]["ours"], name)
        print(report.text())
        unexpected += not report.ok
    print(
        f"\n{len(names) - unexpected}/{len(names)} scenarios without unexpected differences; "
        f"{time.perf_counter() - started:.0f}s; results in {outdir}"
    )
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
