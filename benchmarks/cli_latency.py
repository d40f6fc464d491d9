"""How fast the CLI answers what needs no training: help pages and bad input, against a bare interpreter.

    python -m benchmarks.cli_latency [--repeats 5] [--json FILE]

Each command is a fresh ``python -m trainer_ext ...`` (as the ``trainer-ext`` script runs it), timed best-of
``--repeats``; ``python -c pass`` is the floor. Then one ``-X importtime`` run per command names the slowest
imports (the evidence of what was, or was not, loaded). Run it with ``PYTHONPATH`` on another checkout's copy of the
package to compare two versions of the code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "trainer-ext --help": ["-m", "trainer_ext", "--help"],
    "trainer-ext train --help": ["-m", "trainer_ext", "train", "--help"],
    "trainer-ext train --help_all": ["-m", "trainer_ext", "train", "--help_all"],
    "trainer-ext train --bogus": ["-m", "trainer_ext", "train", "--bogus"],
    "trainer-ext train --max_steps ten": ["-m", "trainer_ext", "train", "--max_steps", "ten"],
    "trainer-ext train --train_file missing.jsonl": ["-m", "trainer_ext", "train", "--train_file", "missing.jsonl"],
}


def _time(argv: list[str], cwd: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - started


def slowest_imports(argv: list[str], cwd: str, n: int = 5) -> list[tuple[str, float]]:
    """The ``n`` imports with the largest cumulative time (seconds) in one ``-X importtime`` run."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=cwd, capture_output=True, text=True)
    rows = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = (part.strip() for part in line[len("import time:") :].split("|"))
            if cumulative.isdigit():
                rows.append((name, int(cumulative) / 1e6))
    top = sorted(rows, key=lambda row: -row[1])
    return [(name, round(seconds, 3)) for name, seconds in top[:n]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as cwd:
        for label, command in COMMANDS.items():
            best = min(_time(command, cwd) for _ in range(args.repeats))
            heavy = {name for name, _ in slowest_imports(command, cwd, n=1000)} & {"torch", "transformers"}
            rows.append({"command": label, "best_s": round(best, 3), "imports_torch_or_transformers": sorted(heavy)})
            rows[-1]["slowest_imports"] = slowest_imports(command, cwd)
            print(f"{label:<48} {best:6.3f} s   heavy imports: {', '.join(sorted(heavy)) or 'none'}", flush=True)
    load = os.getloadavg()[0]
    print(f"load average at the end: {load:.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"loadavg": load, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
