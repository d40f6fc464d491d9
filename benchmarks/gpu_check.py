"""The GPU day-one kit: one command that exercises every CUDA path of trainer_ext and writes what it found.

    python benchmarks/gpu_check.py [--out DIR] [--budget_s 510] [--only a,b] [--skip a,b]   # on a GPU machine
    python benchmarks/gpu_check.py --dry_run [--out DIR]                                     # the same, CPU, tiny

Steps (each its own process, time-boxed; one that fails, hangs or skips does not stop the rest):
``env`` (versions, the GPU, trainer_ext imports without accelerate), ``precision`` (a ~110M Llama in bf16 and fp16,
trainer_ext.Trainer vs transformers' Trainer), ``sharded`` (FSDP2, ZeRO-2, ZeRO-3 on one launched process: save and
exact resume), ``dispatch`` (``dispatch_model`` over a GPU budget smaller than the model), ``context_parallel``
(torch's ring attention and ours on a 1-rank mesh against plain SDPA), ``fp8`` (torchao float8
vs bf16), ``estimate`` (``trainer-ext estimate --measure``), ``tests`` (the tests marked gpu and a CUDA pass of the
device-sensitive tests) and ``throughput_1b`` (a 1.1B Llama, bf16, sequence 2048, eager and ``torch.compile``:
tokens/s, MFU, peak memory, ours vs stock). docs/gpu.md says how to run it on a lent machine.

Writes ``gpu_check.json`` (every figure), ``gpu_check.md`` (the readable summary) and ``gpu_check.log`` (each step's
output) into ``--out`` (default: ``$OUT`` when set, else ``benchmarks/results/gpu_check``), rewritten after every step.
Exit status: 0 when every step ran clean or skipped with its reason, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root importable after an installed trainer_ext
    sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_kit.kit import ROOT, kill_group  # noqa: E402

SKIPPED = 3  # benchmarks.gpu_kit.child's exit status for a step that skipped


@dataclass(frozen=True)
class Step:
    """A step: its module, its time box on the GPU and in the dry run, and the time it is expected to take on an
    H100-class GPU (from its size; docs/gpu.md shows the sum)."""

    name: str
    module: str
    box_s: float
    dry_box_s: float
    expected_s: float


STEPS = (
    Step("env", "benchmarks.gpu_kit.env_step", 40, 90, 8),
    Step("precision", "benchmarks.gpu_kit.precision", 150, 240, 70),
    Step("sharded", "benchmarks.gpu_kit.sharded", 190, 300, 75),
    Step("dispatch", "benchmarks.gpu_kit.dispatch_step", 60, 120, 15),
    # seconds of work in one process; early, where the heavy steps' overruns cannot push it out of the budget
    Step("context_parallel", "benchmarks.gpu_kit.context_parallel_step", 45, 90, 12),
    Step("fp8", "benchmarks.gpu_kit.fp8", 90, 150, 30),
    Step("estimate", "benchmarks.gpu_kit.estimate_step", 90, 180, 35),
    Step("tests", "benchmarks.gpu_kit.tests_step", 150, 180, 80),
    Step("throughput_1b", "benchmarks.gpu_kit.throughput", 270, 240, 170),
)
MIN_STEP_S = 15  # a step is not started with less of the budget left
# the GPU run's budget: one run of the kit and the machine's start fit 15 minutes of device time with room for a
# shorter rerun (docs/gpu.md)
GPU_BUDGET_S = 510
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def run_step(step: Step, dry_run: bool, device: str, work: Path, timeout: float) -> dict[str, Any]:
    """One step in its own process group, killed whole at ``timeout``: its record (status, seconds, figures, output)."""
    result_file = work / f"{step.name}.json"
    cmd = [
        sys.executable, "-m", "benchmarks.gpu_kit.child", step.module, "--name", step.name,
        "--result", str(result_file), "--work", str(work / step.name), "--device", device,
    ] + (["--dry_run"] if dry_run else [])  # fmt: skip
    env = dict(os.environ, **OFFLINE)
    env["PYTHONPATH"] = os.pathsep.join([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(ROOT)])
    started = time.perf_counter()
    log = work / f"{step.name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        kill_group(proc)  # whatever the step left running (a launcher's ranks) goes too
        proc.wait()
    seconds = time.perf_counter() - started
    data = json.loads(result_file.read_text()) if result_file.exists() else {}
    record = {
        "seconds": round(seconds, 1),
        "box_s": round(timeout, 1),
        "figures": data.get("figures", {}),
        "problems": data.get("problems", []),
        "notes": data.get("notes", []),
    }
    output = log.read_text(errors="replace")
    if code is None:
        record["status"] = "timeout"
        record["problems"].append(f"stopped at its time box of {timeout:.0f} s (the figures are what it had)")
    elif code == SKIPPED:
        record["status"] = "skipped"
    elif code != 0:
        record["status"] = "failed"
        record["error"] = record["figures"].pop("error", None) or f"exit {code}"
    else:
        record["status"] = "problems" if record["problems"] else "ok"
    if record["status"] in ("failed", "timeout"):
        record["output_tail"] = "\n".join(output.splitlines()[-40:])
    record["output"] = output
    return record


def summary_lines(step_name: str, module: str, record: dict[str, Any]) -> list[str]:
    """The step's own summary of its figures (its ``summarize``), or nothing when it has none or it breaks."""
    try:
        return list(importlib.import_module(module).summarize(record["figures"]))
    except Exception as exc:  # a summary is never worth losing the rest for
        return [f"(no summary: {type(exc).__name__}: {exc})"]


def write_outputs(out: Path, report: dict[str, Any]) -> None:
    """gpu_check.json, gpu_check.md and gpu_check.log in ``out``, each written beside and renamed over."""
    out.mkdir(parents=True, exist_ok=True)
    logs, lines = [], []
    steps = {name: {k: v for k, v in rec.items() if k != "output"} for name, rec in report["steps"].items()}
    for name, rec in report["steps"].items():
        logs.append(f"===== {name} ({rec.get('status')}, {rec.get('seconds')} s) =====\n{rec.get('output', '')}")
    env = report["steps"].get("env", {}).get("figures", {})
    mode = "dry run on the CPU" if report["dry_run"] else "GPU run"
    lines += [
        f"# GPU kit: {mode}, {report['started']}",
        "",
        f"machine: {env.get('device_name', '?')}; torch {env.get('torch', '?')}, transformers "
        f"{env.get('transformers', '?')}, accelerate {env.get('accelerate', '-')}, deepspeed "
        f"{env.get('deepspeed', '-')}, torchao {env.get('torchao', '-')}",
        f"total {report.get('seconds', 0):.0f} s of a {report['budget_s']:.0f} s budget; exit {report.get('exit')}",
        "",
        "| step | status | seconds (box) |",
        "|---|---|---|",
    ]
    for name, rec in steps.items():
        lines.append(f"| {name} | {rec['status']} | {rec.get('seconds', '-')} ({rec.get('box_s', '-')}) |")
    for step in report["plan"]:
        rec = steps.get(step["name"])
        if rec is None or rec["status"] in ("not_run", "running"):
            continue
        lines += ["", f"## {step['name']}: {rec['status']}", ""]
        lines += [f"- {line}" for line in summary_lines(step["name"], step["module"], rec)]
        lines += [f"- skipped: {rec['figures']['skipped']}"] if "skipped" in rec["figures"] else []
        lines += [f"- note: {n}" for n in rec.get("notes", [])]
        lines += [f"- **problem**: {p}" for p in rec.get("problems", [])]
        if rec.get("error"):
            lines += [f"- **error**: {rec['error']}"]
        if rec.get("output_tail"):
            lines += ["", "```", rec["output_tail"], "```"]
    data = {k: v for k, v in report.items() if k != "steps"} | {"steps": steps}
    for name, text in (
        ("gpu_check.json", json.dumps(data, indent=1, default=str)),
        ("gpu_check.md", "\n".join(lines) + "\n"),
        ("gpu_check.log", "\n".join(logs)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def run_steps(
    steps: list[Step], dry_run: bool, device: str, out: Path, budget_s: float, work: Path | None = None
) -> dict[str, Any]:
    """Every step in order within ``budget_s`` seconds in all; the outputs rewritten after each."""
    started = time.perf_counter()
    report: dict[str, Any] = {
        "kit": 1,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": dry_run,
        "device": device,
        "budget_s": budget_s,
        "expected_s": sum(s.expected_s for s in steps),
        "plan": [{"name": s.name, "module": s.module, "expected_s": s.expected_s} for s in steps],
        "steps": {s.name: {"status": "not_run"} for s in steps},
    }
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="gpu_check_")) if work is None else work
    work.mkdir(parents=True, exist_ok=True)
    try:
        for step in steps:
            left = budget_s - (time.perf_counter() - started)
            box = step.dry_box_s if dry_run else step.box_s
            if left < MIN_STEP_S:
                report["steps"][step.name] = {"status": "not_run", "problems": [f"out of budget ({left:.0f} s left)"]}
                continue
            report["steps"][step.name] = {"status": "running"}
            report["seconds"] = time.perf_counter() - started
            write_outputs(out, report)
            print(f"[gpu_check] {step.name} (box {min(box, left):.0f} s)", flush=True)
            record = run_step(step, dry_run, device, work, min(box, left))
            report["steps"][step.name] = record
            print(f"[gpu_check] {step.name}: {record['status']} in {record['seconds']} s", flush=True)
            for problem in record["problems"]:
                print(f"[gpu_check]   problem: {problem}", flush=True)
            if record.get("error"):
                print(f"[gpu_check]   error: {record['error'].splitlines()[-1]}", flush=True)
            report["seconds"] = time.perf_counter() - started
            write_outputs(out, report)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    clean = all(rec["status"] in ("ok", "skipped") for rec in report["steps"].values())
    report["exit"] = 0 if clean else 1
    report["seconds"] = time.perf_counter() - started
    write_outputs(out, report)
    return report


def select(only: str | None, skip: str | None) -> list[Step]:
    """The steps to run, in the kit's order; SystemExit(2) naming an unknown step."""
    names = [s.name for s in STEPS]
    wanted = [n.strip() for n in only.split(",") if n.strip()] if only else names
    dropped = [n.strip() for n in skip.split(",") if n.strip()] if skip else []
    unknown = sorted(set(wanted + dropped) - set(names))
    if unknown:
        print(f"gpu_check: unknown step {', '.join(unknown)}; the steps are {', '.join(names)}", file=sys.stderr)
        raise SystemExit(2)
    return [s for s in STEPS if s.name in wanted and s.name not in dropped]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry_run", action="store_true", help="the same code paths on the CPU, tiny configs")
    default_out = os.environ.get("OUT") or str(ROOT / "benchmarks" / "results" / "gpu_check")
    parser.add_argument("--out", type=Path, default=Path(default_out), help="where the outputs go (default: $OUT)")
    parser.add_argument(
        "--budget_s", type=float, default=None,
        help=f"seconds for all steps together (default {GPU_BUDGET_S:.0f} on the GPU; the dry run: its boxes' sum)",
    )  # fmt: skip
    parser.add_argument("--only", default=None, help="comma-separated steps to run (default: all)")
    parser.add_argument("--skip", default=None, help="comma-separated steps to leave out")
    opts = parser.parse_args(argv)
    steps = select(opts.only, opts.skip)
    import torch

    if not opts.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; run it on the lent GPU machine, or pass --dry_run", file=sys.stderr)
        return 2
    device = "cpu" if opts.dry_run else "cuda"
    budget = opts.budget_s or (sum(s.dry_box_s for s in steps) if opts.dry_run else GPU_BUDGET_S)
    report = run_steps(steps, opts.dry_run, device, opts.out, budget)
    print(f"[gpu_check] done in {report['seconds']:.0f} s: {opts.out / 'gpu_check.md'}", flush=True)
    return report["exit"]


if __name__ == "__main__":
    sys.exit(main())
