"""Run the scenarios under both implementations on 1 and 2 processes, compare, print a table.

    python -m tests.accelerator_parity.run_all                       # everything
    python -m tests.accelerator_parity.run_all -k resume --nproc 2   # names containing "resume", 2 processes
    python -m tests.accelerator_parity.run_all --outdir /tmp/accparity  # keep the JSON results there

(from the repository root, in an environment with accelerate). Results: OUTDIR/SCENARIO.IMPL.NPROC.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tests.parity_harness.compare import worst_of
from tests.parity_harness.registry import matching
from tests.parity_harness.runner import batch_command, result_path, side_by_side

from .compare import Report, compare, load
from .registry import ALL_NPROCS, CASES, IMPLS
from .run import PHASE_TIMEOUT_S


def run_many(cases: list[tuple[str, int]], outdir: Path, jobs: int = 2, timeout: float = PHASE_TIMEOUT_S) -> dict:
    """Every (scenario, nproc) under both implementations, ``jobs`` batches at a time; ``{case: Report}``.

    Each implementation is one batch process (``run --batch``): its ranks are forked from a server that imported it
    once. A batch that dies leaves its remaining cases without a result, reported as such.
    """
    outdir.mkdir(parents=True, exist_ok=True)
    batch = [f"{scenario}:{nproc}" for scenario, nproc in cases]
    failures = side_by_side(
        lambda impl: batch_command(
            "tests.accelerator_parity.run", impl, "--timeout", str(timeout), "--outdir", str(outdir), "--batch", *batch
        ),
        jobs=jobs,
    )
    reports = {}
    for scenario, nproc in cases:
        stock, ours = (result_path(outdir, scenario, impl, nproc) for impl in IMPLS)
        missing = [
            f"{p.name} missing (batch {failures[i] or 'ended'})"
            for i, p in zip(IMPLS, (stock, ours), strict=True)
            if not p.exists()
        ]
        if missing:
            raise RuntimeError(f"{scenario} on {nproc} processes: {'; '.join(missing)}")
        reports[(scenario, nproc)] = compare(load(stock), load(ours), outdir, outdir)
    return reports


def table(reports: dict[tuple[str, int], Report]) -> str:
    rows = ["| scenario | procs | result | first difference |", "|---|---|---|---|"]
    for (scenario, nproc), report in reports.items():
        first = report.failures[0].replace("|", "\\|") if report.failures else ""
        more = f" (+{len(report.failures) - 1} more)" if len(report.failures) > 1 else ""
        rows.append(f"| {scenario} | {nproc} | {'pass' if report.ok else 'FAIL'} | {first[:200]}{more} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="only the scenarios whose name contains this")
    parser.add_argument("--nproc", type=int, action="append", choices=ALL_NPROCS, help="only this process count")
    parser.add_argument("--outdir", help="where the results go (default: a temporary folder, kept)")
    parser.add_argument("--jobs", type=int, default=2, help="batches at a time (one per implementation: 1 or 2)")
    parser.add_argument("--timeout", type=float, default=PHASE_TIMEOUT_S, help="seconds one phase may take")
    options = parser.parse_args(argv)
    names = matching([name for name, _ in CASES], options.k)
    cases = [(name, nproc) for name, nproc in CASES if name in names and (not options.nproc or nproc in options.nproc)]
    outdir = Path(options.outdir or tempfile.mkdtemp(prefix="accparity-results-"))
    started = time.perf_counter()
    reports = run_many(cases, outdir, options.jobs, options.timeout)
    for report in reports.values():
        print(report.text())
    print()
    print(table(reports))
    worst: dict[str, float] = {}
    for report in reports.values():
        for kind, error in report.worst.items():
            worst_of(worst, kind, error)
    print(
        "\nlargest stock-vs-ours errors (relative; weights: max abs):",
        ", ".join(f"{k} {v:.3g}" for k, v in sorted(worst.items())),
    )
    failed = sum(not r.ok for r in reports.values())
    print(f"\n{len(reports) - failed}/{len(reports)} pass; {time.perf_counter() - started:.0f}s; results in {outdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
