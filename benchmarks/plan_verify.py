"""``trainer-ext plan --verify`` for every layout family: predicted against measured per-rank memory and bytes per
collective, on 2 and 4 gloo processes.

    python -m benchmarks.plan_verify [--config full|tiny] [--families ddp,fsdp,...] [--processes 2,4]
                                     [--out FILE] [--json FILE]

For each (family, processes) the layout is the plan's :class:`~trainer_ext.plan.layouts.Layout`, its train flags
(``Layout.flags()``) added to one small job (``--model_config tiny-llama --task causal-lm --max_seq_length 64``,
micro-batch 4; the pipeline families ``tiny-llama-untied``, 4 pipeline microbatches). The prediction is the plan's:
the estimator's :class:`~trainer_ext.estimate.breakdown.Breakdown` and :func:`~trainer_ext.plan.comms.step_traffic`
for the layout's Setup as the planner reads it (``candidate_setup``); the Setup ``train`` itself reads from the same
flags (``job_from_argv``) must give the same figures, or the row says so. The measurement is
:func:`~trainer_ext.plan.worker.measure_layout`: two real optimizer steps under ``torch.distributed.run`` on gloo
(``OMP_NUM_THREADS=1``, ``DS_ACCELERATOR=cpu``), the busiest rank's memory as the estimator's measure callback counts
it (tensors held + saved for backward, not an allocator peak) and the bytes of each collective of the second step.

A row passes when the total, the weights, the gradients and the optimizer state are each within 15 % of the
measured, and so is every collective the model predicts or that carries at least 1 % of the counted bytes (smaller
unmodelled ones, such as the gradient-norm all-reduce, are listed and not scored), as ``plan --verify`` reads them.
The tables go to stdout and, as markdown with the command and the machine, to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOLERANCE = 0.15
SMALL = 0.01  # an unmodelled collective under this share of the counted bytes is listed, not scored
STATES = ("weights", "gradients", "optimizer")
MIB = 2**20
JOB = ["--model_config", "tiny-llama", "--task", "causal-lm", "--max_seq_length", "64"]
UNTIED = ["--model_config", "tiny-llama-untied", "--task", "causal-lm", "--max_seq_length", "64"]
MICRO_BATCH = 4

# family -> (label, {processes: Layout keyword arguments}); the pipeline families run the untied model
FAMILIES: dict[str, tuple[str, dict[int, dict[str, Any]]]] = {
    "ddp": ("DDP", {n: dict(family="ddp", dp_replicate=n) for n in (2, 4)}),
    "fsdp": ("FSDP2 full_shard", {n: dict(family="fsdp", dp_shard=n) for n in (2, 4)}),
    "fsdp_sgo": ("FSDP2 shard_grad_op", {n: dict(family="fsdp", dp_shard=n, reshard=False) for n in (2, 4)}),
    "hsdp": ("HSDP 2 x 2", {4: dict(family="hsdp", dp_replicate=2, dp_shard=2)}),
    "zero1": ("ZeRO-1", {n: dict(family="zero1", dp_replicate=n) for n in (2, 4)}),
    "zero2": ("ZeRO-2", {n: dict(family="zero2", dp_replicate=n) for n in (2, 4)}),
    "zero3": ("ZeRO-3", {n: dict(family="zero3", dp_replicate=n) for n in (2, 4)}),
    "tp": ("TP 2", {2: dict(family="fsdp", tp=2)}),
    "fsdp_tp": ("FSDP2 x TP 2 x 2", {4: dict(family="fsdp", dp_shard=2, tp=2)}),
    "cp": ("CP 2", {2: dict(family="fsdp", cp=2), 4: dict(family="fsdp", dp_shard=2, cp=2)}),
    "pp": ("PP 2", {2: dict(family="fsdp", pp=2, pp_microbatches=MICRO_BATCH)}),
    "pp_dp": ("PP 2 x dp_shard 2", {4: dict(family="fsdp", dp_shard=2, pp=2, pp_microbatches=MICRO_BATCH)}),
}
CONFIGS = {
    "full": {"families": list(FAMILIES), "processes": [2, 4]},
    "tiny": {"families": ["ddp", "fsdp"], "processes": [2]},  # a smoke run
}


def layout_of(family: str, processes: int) -> Any:
    from trainer_ext.plan.layouts import Layout

    return Layout(**FAMILIES[family][1][processes], micro_batch=MICRO_BATCH)


def train_argv(family: str, layout: Any) -> list[str]:
    """The job's flags with the layout's; the shipped DeepSpeed configs by their absolute path."""
    flags = layout.flags()
    flags = [str(ROOT / f) if f.startswith("configs/deepspeed/") else f for f in flags]
    return [*(UNTIED if layout.pp > 1 else JOB), *flags]


def predict(argv: list[str], layout: Any) -> dict[str, Any]:
    """The plan's prediction for the layout (memory keys, bytes per collective), its Setup, and whether the Setup
    train reads from the same flags predicts the same."""
    from trainer_ext.estimate.breakdown import estimate
    from trainer_ext.estimate.job import job_from_argv
    from trainer_ext.job.flags import parse_train_values
    from trainer_ext.plan.comms import by_collective, step_traffic
    from trainer_ext.plan.planner import base_values, candidate_setup

    job = job_from_argv(argv, layout.world)
    values = parse_train_values(argv)[0]
    setup = candidate_setup(base_values(values, job), layout, job.setup.seq_len, "cpu")

    def figures(s: Any) -> tuple[dict[str, int], dict[str, int]]:
        memory = estimate(job.shape, s)
        keys = {key: int(getattr(memory, key)) for key in (*STATES, "activations", "total")}
        return keys, by_collective(step_traffic(job.shape, s))

    memory, collectives = figures(setup)
    same = figures(job.setup) == (memory, collectives)
    return {"setup": setup, "memory": memory, "collectives": collectives, "train_setup_agrees": same}


def _error(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured else None


def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Each figure as [predicted, measured, error]; the collectives scored as ``plan --verify`` scores them."""
    memory = {key: predicted["memory"][key] for key in (*STATES, "activations", "total")}
    memory["states"] = sum(memory[key] for key in STATES)
    real = {key: int(measured.get(key, 0)) for key in (*STATES, "activations", "total", "weight_copies")}
    real["states"] = sum(real[key] for key in STATES)
    rows = {key: [memory[key], real[key], _error(memory[key], real[key])] for key in memory}
    rows["weight_copies"] = [None, real["weight_copies"], None]
    counted = {k: int(v) for k, v in measured.get("collectives", {}).items() if v and k != "recv"}
    guessed = predicted["collectives"]
    everything = max(sum(counted.values()), 1)
    scored = {
        kind: [guessed.get(kind, 0), counted.get(kind, 0), _error(guessed.get(kind, 0), counted.get(kind, 0))]
        for kind in sorted(set(guessed) | set(counted))
        if guessed.get(kind) or counted.get(kind, 0) >= SMALL * everything
    }
    small = {kind: counted[kind] for kind in sorted(counted) if kind not in scored}
    misses = [key for key in ("total", *STATES) if not _within(rows[key][2])]
    misses += [kind for kind, row in scored.items() if not _within(row[2])]
    if not predicted["train_setup_agrees"]:
        misses.append("train's Setup predicts otherwise")
    return {"memory": rows, "collectives": scored, "not_modelled": small, "misses": misses, "passed": not misses}


def _within(error: float | None) -> bool:
    return error is not None and abs(error) <= TOLERANCE


def run_one(family: str, processes: int) -> dict[str, Any]:
    from trainer_ext.plan.worker import measure_layout

    layout = layout_of(family, processes)
    argv = train_argv(family, layout)
    row: dict[str, Any] = {"family": family, "label": FAMILIES[family][0], "processes": processes}
    row.update(layout=layout.name(), argv=argv)
    started = time.perf_counter()
    try:
        predicted = predict(argv, layout)
        measured = measure_layout(argv, processes, setup=predicted["setup"])
    except Exception as error:  # a failed run is a row of the table, not the end of the benchmark
        row.update(error=f"{type(error).__name__}: {error}", passed=False, seconds=time.perf_counter() - started)
        return row
    row.update(compare(predicted, measured), seconds=time.perf_counter() - started)
    row["train_setup_agrees"] = predicted["train_setup_agrees"]
    row["dimensions"] = measured.get("dimensions", {})
    return row


def _mib(nbytes: float | None, digits: int = 2) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.{digits}f}"


def _pct(error: float | None) -> str:
    return "n/a" if error is None else f"{error:+.1%}"


def _collectives(row: dict[str, Any]) -> str:
    cells = [
        f"{kind} {_mib(p, 3)} / {_mib(c, 3)} ({_pct(e)})" for kind, (p, c, e) in row.get("collectives", {}).items()
    ]
    return "; ".join(cells) or "-"


def table(rows: list[dict[str, Any]]) -> str:
    """The main table: total and states per rank, bytes per collective, pass/fail."""
    lines = [
        "| family | procs | layout | total est MiB | total meas MiB | error | states est MiB | states meas MiB | error "
        "| collectives: predicted / counted MiB (error) | s | within 15 % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        head = f"| {row['label']} | {row['processes']} | {row['layout']} "
        if "error" in row:
            lines.append(
                head + f"| run failed: {row['error'].splitlines()[0][:120]} ||||||| {row['seconds']:.0f} | FAIL |"
            )
            continue
        memory = row["memory"]
        total, states = memory["total"], memory["states"]
        verdict = "pass" if row["passed"] else "FAIL: " + ", ".join(row["misses"])
        lines.append(
            head + f"| {_mib(total[0])} | {_mib(total[1])} | {_pct(total[2])} | {_mib(states[0])} | {_mib(states[1])} "
            f"| {_pct(states[2])} | {_collectives(row)} | {row['seconds']:.0f} | {verdict} |"
        )
    return "\n".join(lines)


def detail_table(rows: list[dict[str, Any]]) -> str:
    """Each state and the activations, predicted / measured MiB (error); unmodelled small collectives."""
    lines = [
        "| family | procs | weights | gradients | optimizer | activations | weight copies meas | not modelled (bytes) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            continue
        memory = row["memory"]
        cells = [
            f"{_mib(p, 3)} / {_mib(m, 3)} ({_pct(e)})" for p, m, e in (memory[k] for k in (*STATES, "activations"))
        ]
        small = ", ".join(f"{kind} {nbytes:,}" for kind, nbytes in row["not_modelled"].items()) or "-"
        lines.append(
            f"| {row['label']} | {row['processes']} | {' | '.join(cells)} | {_mib(memory['weight_copies'][1], 3)} "
            f"| {small} |"
        )
    return "\n".join(lines)


def _versions() -> str:
    import torch
    import transformers

    found = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    try:
        from importlib.metadata import version

        found.append(f"deepspeed {version('deepspeed')}")
    except Exception:
        found.append("deepspeed not installed")
    return ", ".join(found)


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def markdown(rows: list[dict[str, Any]], command: str, wall: float) -> str:
    dirty = [line[3:] for line in _git("status", "--porcelain", "--", "trainer_ext").splitlines() if line.strip()]
    passed = sum(1 for row in rows if row.get("passed"))
    code = f"commit {_git('rev-parse', '--short', 'HEAD')}"
    if dirty:
        code += f", with uncommitted changes in {', '.join(dirty)} (other work in the same checkout)"
    return "\n".join(
        [
            "# benchmarks.plan_verify: the plan's predicted memory and communication against two real steps",
            "",
            f"- Command: `{command}`",
            f"- Date: {datetime.date.today().isoformat()}. Code: {code}.",
            f"- Machine: {os.cpu_count()} CPU cores, no GPU, {platform.platform()}, Python "
            f"{platform.python_version()}; {_versions()}. Each run is `torch.distributed.run` on gloo with "
            "`OMP_NUM_THREADS=1` (`DS_ACCELERATOR=cpu`).",
            "- Job: " + " ".join(JOB) + f", micro-batch {MICRO_BATCH}, accumulation 1, float32, AdamW; the pipeline "
            f"families `tiny-llama-untied`, 1f1b, {MICRO_BATCH} microbatches. Layout flags from `Layout.flags()`.",
            "- **Tiny models on CPU gloo.** Memory is what the estimator's measure callback counts on the busiest "
            "rank (tensors held + saved for backward, the largest of each key over the ranks), not an allocator "
            "peak; activations dominate these totals. Collectives: bytes of the second optimizer step, "
            "`trainer_ext.plan.counting`'s convention, the largest over the ranks.",
            f"- A row passes when total, weights, gradients, optimizer and every scored collective are within "
            f"{TOLERANCE:.0%} of the measurement (errors are (predicted - measured) / measured).",
            f"- Result: {passed} of {len(rows)} rows pass. Wall time {wall:.0f} s in all (`s`: one row's prediction "
            "and run, launch included).",
            "",
            table(rows),
            "",
            "Predicted / measured MiB (error) of each state and the activations; collectives under 1 % of the "
            "counted bytes that the model leaves out:",
            "",
            detail_table(rows),
            "",
        ]
    )


def _parse_list(text: str, allowed: list[Any], what: str, parser: argparse.ArgumentParser, kind: Any = str) -> list:
    try:
        items = [kind(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError:
        parser.error(f"--{what} {text}: give a comma-separated list of {', '.join(map(str, allowed))}")
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        parser.error(f"--{what} {text}: choose among {', '.join(map(str, allowed))}")
    return items


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="full", help="full, or tiny (a smoke run)")
    parser.add_argument("--families", default=None, help="subset of " + ", ".join(FAMILIES))
    parser.add_argument("--processes", default=None, help="subset of 2,4 (families that allow it)")
    parser.add_argument("--out", type=Path, default=None, help="markdown results (default benchmarks/results/...)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure as JSON")
    opts = parser.parse_args(argv)
    config = CONFIGS[opts.config]
    families = _parse_list(opts.families, list(FAMILIES), "families", parser) if opts.families else config["families"]
    counts = _parse_list(opts.processes, [2, 4], "processes", parser, int) if opts.processes else config["processes"]
    cases = [(f, n) for f in families for n in sorted(counts) if n in FAMILIES[f][1]]
    if not cases:
        parser.error(f"--families {','.join(families)} runs on none of --processes {','.join(map(str, counts))}")
    out = opts.out or ROOT / "benchmarks" / "results" / (
        f"plan_verify_{datetime.date.today().isoformat()}_{max(n for _, n in cases)}gloo.md"
    )
    os.environ["OMP_NUM_THREADS"] = "1"  # the children's; measure_layout passes the environment on
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    started, rows = time.perf_counter(), []
    for family, processes in cases:
        print(f"{FAMILIES[family][0]} on {processes} processes ...", flush=True)
        rows.append(run_one(family, processes))
    wall = time.perf_counter() - started
    command = "python -m benchmarks.plan_verify " + " ".join(argv if argv is not None else sys.argv[1:])
    print(table(rows))
    print()
    print(detail_table(rows))
    print(f"\n{sum(1 for r in rows if r.get('passed'))} of {len(rows)} rows within {TOLERANCE:.0%}; {wall:.0f} s")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(rows, command.strip(), wall))
    print(f"written to {out}")
    report = {"config": opts.config, "wall_seconds": wall, "rows": rows}
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    sys.exit(1 if any("error" in row for row in main()["rows"]) else 0)
