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
import sys
import tempfile
import time
from pathlib import Path

from tests.parity_harness.registry import matching
from tests.parity_harness.runner import batch_command, result_path, side_by_side

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


def run_both(names: list[str], outdir: Path, ours: str = "ours") -> dict[str, dict[str, dict]]:
    """Every named scenario under stock and under ours (the two implementations side by side).

    Each implementation gets one process that imports it, then forks one child per scenario. Returns
    ``{name: {"stock": result, "ours": result}}``; a result that could not be read is a harness error.
    """
    outdir.mkdir(parents=True, exist_ok=True)
    scenarios = [arg for name in names for arg in ("--scenario", name)]
    failures = side_by_side(
        lambda impl: batch_command("tests.parity.run_scenario", impl, "--outdir", str(outdir), *scenarios),
        ("stock", ours),
        timeout=60 + TIMEOUT_S * len(names),
    )
    results: dict[str, dict[str, dict]] = {}
    for name in names:
        results[name] = {}
        for impl, side in (("stock", "stock"), (ours, "ours")):
            path = result_path(outdir, name, impl)
            if path.exists():
                results[name][side] = json.loads(path.read_text())
            else:
                results[name][side] = {"harness_error": failures[impl] or f"no result at {path}"}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="run the scenarios whose name contains this")
    parser.add_argument("--outdir", help="where the JSON results go (default: a temporary folder, kept)")
    parser.add_argument("--ours", default="ours", choices=("ours", "ours+accelerate"))
    options = parser.parse_args(argv)
    names = matching(scenario_names(), options.k)
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
