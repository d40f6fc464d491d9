"""Time to a result: the README's ``trainer-ext train``, wall time and where it goes.

    python -m benchmarks.time_to_result [--repeats R] [--loads 0,3,4] [--json FILE] [-- TRAIN FLAGS...]

Each run is a fresh interpreter, as a user's command is. The wall time is the best of ``--repeats`` plain runs
(``python -m trainer_ext train``); one more run is timed phase by phase (the job's own functions wrapped with a
clock, nothing else changed): interpreter start and imports, data, tokenizer, model, tokenizing, the Trainer's
construction, the other start-up checks, training, the final model save, evaluation, the report, the rest.
With ``--loads``, the plain runs are repeated with that many busy-looping processes added (a load of L on the
machine, ``benchmarks.threads.Load``) and each wall time is also given as a ratio to the quiet one of the same run.
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

ROOT = Path(__file__).resolve().parent.parent

# (label, module, attribute): each is timed on its own; "training" is Trainer.train minus the final save in it
PHASES = (
    ("data (load_dataset)", "trainer_ext.job.run", "load_raw_datasets"),
    ("tokenizer build", "trainer_ext.job.run", "build_tokenizer"),
    ("model build", "trainer_ext.job.run", "build_model"),
    ("tokenizing (datasets.map)", "trainer_ext.job.run", "tokenize"),
    ("Trainer construction", "trainer_ext.trainer.trainer", "Trainer.__init__"),
    ("training", "trainer_ext.trainer.checkpoints", "CheckpointingMixin.train"),
    (
        "final model save and reload check",
        "trainer_ext.callbacks.unwrap_and_save",
        "UnwrapAndSaveCallback.on_train_end",
    ),
    ("evaluation", "transformers.trainer", "Trainer.evaluate"),
    ("report", "trainer_ext.report.callback", "ReportCallback._write"),
)

_CHILD = r"""
import functools, importlib, json, sys, time
started = time.perf_counter()
spent, order = {}, []
from trainer_ext.cli.main import main
import trainer_ext.job.run, trainer_ext.trainer.trainer  # what `trainer-ext train` imports before it starts the job
imports = time.perf_counter() - started

inside_training = [False]

def timed(label, owner, name):
    original = getattr(owner, name)
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        # evaluation and report writes inside train() are taken out of "training" below
        key = f"{label} during training" if inside_training[0] and label in ("evaluation", "report") else label
        inside_training[0] |= label == "training"
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t
            if label == "training":
                inside_training[0] = False
    setattr(owner, name, wrapper)

for label, module, attribute in PHASES:
    owner = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    if hasattr(owner, name):
        timed(label, owner, name)
job = time.perf_counter()
code = main(sys.argv[1:])
inner = ("final model save and reload check", "evaluation during training", "report during training")
spent["training"] = spent.get("training", 0.0) - sum(spent.get(k, 0.0) for k in inner)
total = time.perf_counter() - started
print("PHASES " + json.dumps({"imports": imports, **spent, "job": time.perf_counter() - job, "total": total}))
sys.exit(code)
"""


def _child_code() -> str:
    return f"PHASES = {PHASES!r}\n" + _CHILD


def _run(cmd: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="plain runs; the best wall time is kept")
    parser.add_argument("--loads", default="0", help="busy processes added, comma-separated (0 first: the baseline)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("train_flags", nargs="*", help="flags for trainer-ext train (after --)")
    opts = parser.parse_args(argv)
    from benchmarks.threads import Load

    loads = [int(x) for x in opts.loads.split(",")]
    walls: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for load in loads:
            with Load(load):
                walls[load] = []
                for i in range(opts.repeats):
                    out = ["--output_dir", str(Path(tmp) / f"plain{load}-{i}")]
                    walls[load].append(
                        _run([sys.executable, "-m", "trainer_ext", "train", *out, *opts.train_flags])[0]
                    )
        out = ["train", "--output_dir", str(Path(tmp) / "phased"), *opts.train_flags]
        phased_wall, stdout = _run([sys.executable, "-c", _child_code(), *out])
    phases = json.loads(next(line for line in stdout.splitlines() if line.startswith("PHASES "))[7:])
    print(f"trainer-ext train {' '.join(opts.train_flags)}".rstrip())
    base = min(walls[loads[0]])
    for load in loads:
        ratio = f", {min(walls[load]) / base:.2f}x load {loads[0]}" if load != loads[0] else ""
        every = ", ".join(f"{w:.2f}" for w in walls[load])
        print(f"load +{load}: wall time, best of {opts.repeats}: {min(walls[load]):.2f} s (all: {every}){ratio}")
    print(f"phases of one more run, quiet ({phased_wall:.2f} s wall):")
    named = {k: v for k, v in phases.items() if k not in ("job", "total")}
    accounted = sum(named.values())
    for label, seconds in named.items():
        print(f"  {label:36} {seconds:6.2f} s")
    print(f"  {'interpreter start and the rest':36} {phased_wall - accounted:6.2f} s")
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cores": len(os.sched_getaffinity(0)),
        "wall_s": base,
        **phases,
        "loads": {str(k): {"walls_s": v, "best_s": min(v)} for k, v in walls.items()},
    }
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
