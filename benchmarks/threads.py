"""CPU threads per process: the default job under each thread setting, on a quiet and on a loaded machine.

    python -m benchmarks.threads [--loads 0,4] [--nprocs 1,2] [--settings all,all-passive,one,default]
                                 [--repeats 2] [--max_steps 30] [--json FILE]

Each run is a fresh ``trainer-ext train`` (``trainer-ext launch --cpu --num_processes N train`` for N > 1) with the
thread settings given explicitly in its environment, so the figures do not depend on the default policy; the
``default`` row sets nothing and shows what the code under test chooses (run it with ``PYTHONPATH`` on another
checkout's copy of the package to compare two versions of the code). A load of L is L busy-looping processes started
for the run (the machine's own load average is recorded beside it). The figure is the Trainer's ``train_runtime``
(training only, start-up excluded) and the wall time of the whole command, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
# a busy loop that ends with the benchmark, however the benchmark ends
_BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


def settings() -> dict[str, tuple[str, dict[str, str] | None]]:
    """Name -> (label, environment) of each thread setting compared (None: nothing set, the default decides)."""
    every = str(CORES)
    return {
        "all": (f"{every} threads/process, OpenMP's default wait", {"OMP_NUM_THREADS": every, "OMP_WAIT_POLICY": ""}),
        "all-passive": (
            f"{every} threads/process, passive wait",
            {"OMP_NUM_THREADS": every, "OMP_WAIT_POLICY": "PASSIVE"},
        ),
        "one": ("1 thread/process, OpenMP's default wait", {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": ""}),
        "default": ("nothing set (the default of the code under test)", None),
    }


def _command(nproc: int, out: str, max_steps: int) -> list[str]:
    train = ["train", "--max_steps", str(max_steps), "--output_dir", out, "--report_plots", "false"]
    if nproc == 1:
        return [sys.executable, "-m", "trainer_ext", *train]
    return [sys.executable, "-m", "trainer_ext", "launch", "--cpu", "--num_processes", str(nproc), *train]


def run_once(nproc: int, env_extra: dict[str, str] | None, max_steps: int) -> dict[str, float]:
    """One job: its training seconds (train_runtime) and the command's wall seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "TRAINER_EXT_THREADS"))}
    env.update({k: v for k, v in (env_extra or {}).items() if v})
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        started = time.perf_counter()
        proc = subprocess.run(_command(nproc, out, max_steps), cwd=tmp, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"the job failed:\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, "train_results.json")) as f:
            train_runtime = json.load(f)["train_runtime"]
    return {"train_s": train_runtime, "wall_s": wall}


class Load:
    """``n`` busy-looping processes while the context is open."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def __enter__(self) -> Load:
        self.procs = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(self.n)]
        if self.n:
            time.sleep(2)
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loads", default="0,4", help="busy processes added, comma-separated")
    parser.add_argument("--nprocs", default="1,2", help="training processes, comma-separated")
    parser.add_argument("--settings", default=",".join(settings()), help="which settings, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    print(f"{CORES} cores; training seconds (wall seconds), median of {args.repeats}", flush=True)
    for load in [int(x) for x in args.loads.split(",")]:
        for nproc in [int(x) for x in args.nprocs.split(",")]:
            for name in args.settings.split(","):
                label, env = settings()[name]
                with Load(load):
                    before = os.getloadavg()[0]
                    runs = [run_once(nproc, env, args.max_steps) for _ in range(args.repeats)]
                row = {
                    "added_load": load,
                    "nproc": nproc,
                    "setting": name,
                    "label": label,
                    "loadavg_at_start": round(before, 2),
                    "train_s": round(statistics.median(r["train_s"] for r in runs), 2),
                    "wall_s": round(statistics.median(r["wall_s"] for r in runs), 2),
                    "runs": runs,
                }
                rows.append(row)
                print(
                    f"load +{load} (avg {before:4.1f})  {nproc} proc  {label:<38} "
                    f"{row['train_s']:7.2f} s ({row['wall_s']:.1f} s)",
                    flush=True,
                )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"cores": CORES, "max_steps": args.max_steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
