"""The summary table at the top of the report: what the run was, how far it got, what it reached, where it is."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import struct
from pathlib import Path
from typing import Any

from .run import EVAL_SPEED, RunData

# metrics where higher is better; any other is taken as lower-is-better (losses, perplexity)
HIGHER_IS_BETTER = ("accuracy", "f1", "precision", "recall", "matthews", "bleu", "rouge", "exact_match", "auc")
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "adapter_model.safetensors")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1:
        return f"{int(value):,}"
    return f"{value:.4g}"


def higher_is_better(name: str) -> bool:
    return any(word in name for word in HIGHER_IS_BETTER) and "loss" not in name


def _params(path: Path) -> int | None:
    """Parameter count from a safetensors header (8-byte length, then JSON): no tensor is read."""
    try:
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            if size > 100_000_000:
                return None
            header = json.loads(handle.read(size))
    except (OSError, ValueError, struct.error):
        return None
    total = 0
    for name, info in header.items():
        if name != "__metadata__" and isinstance(info, dict):
            count = 1
            for dim in info.get("shape", []):
                count *= dim
            total += count
    return total


def model_text(run: RunData) -> str:
    job = run.job or {}
    name = job.get("model_name_or_path") or (
        f"{job['model_config']} (from scratch)" if job.get("model_config") else None
    )
    config = {}
    for folder in [run.path] + [c.path for c in reversed(run.checkpoints) if c.path is not None]:
        if (folder / "config.json").is_file():
            try:
                config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            except ValueError:
                config = {}
            break
    parts = [name] if name else []
    kind = (config.get("architectures") or [config.get("model_type")])[0] if config else None
    if kind:
        parts.append(str(kind))
    for file in ("model.safetensors", "adapter_model.safetensors"):
        count = _params(run.path / file)
        if count:
            parts.append(f"{count / 1e6:.2f} M parameters" + (" (adapter)" if file.startswith("adapter") else ""))
            break
    return ", ".join(parts) or "unknown (no trainer_ext_run.json or config.json)"


def data_text(run: RunData) -> str:
    job = run.job or {}
    source = job.get("dataset_name") or job.get("train_file")
    if not source:
        return "unknown (not recorded: not a trainer-ext train job)"
    if job.get("dataset_config_name"):
        source += f" ({job['dataset_config_name']})"
    parts = [source]
    if job.get("validation_file"):
        parts.append(f"validation: {job['validation_file']}")
    counts = [
        f"{number(run.results[k])} {k.split('_')[0]}" for k in ("train_samples", "eval_samples") if k in run.results
    ]
    if counts:
        parts.append(" / ".join(counts) + " samples")
    return "; ".join(parts)


def _setup(run: RunData) -> dict[str, Any]:
    """World size, strategy, precision, batch: from the last start event, else the newest checkpoint's marker."""
    start = run.last_start()
    marker = next((c.marker for c in reversed(run.checkpoints) if c.marker), {})
    return {
        "world_size": start.get("world_size") or marker.get("world_size"),
        "strategy": start.get("strategy") or marker.get("strategy"),
        "precision": start.get("precision"),
        "global_batch": start.get("global_batch") or marker.get("global_batch_size"),
        "per_device": start.get("per_device_batch") or marker.get("micro_batch_size"),
        "accumulation": start.get("accumulation"),
    }


def _precision(value: str | None) -> str:
    if not value:
        return "unknown (not recorded)"
    return "fp32 (no mixed precision)" if value == "no" else value


def final_metrics(run: RunData) -> dict[str, tuple[int, float]]:
    """The last value of the training loss and of each eval metric, with its step."""
    out: dict[str, tuple[int, float]] = {}
    steps, losses = run.series("loss")
    if losses:
        out["loss"] = (steps[-1], losses[-1])
    for name in run.eval_metric_names():
        steps, values = run.eval_series(name)
        if values:
            out[name] = (steps[-1], values[-1])
    for name, value in run.results.items():  # train() adds a few after its last evaluation (e.g. the baseline)
        if name.startswith("eval_") and name not in out and name not in EVAL_SPEED and isinstance(value, (int, float)):
            out[name] = (run.global_step, float(value))
    return out


def best_metrics(run: RunData) -> dict[str, tuple[int, float]]:
    """The best value of each eval metric (and of the training loss) with its step."""
    out: dict[str, tuple[int, float]] = {}
    for name in ["loss", *run.eval_metric_names()]:
        steps, values = run.series(name) if name == "loss" else run.eval_series(name)
        if values:
            pick = max if higher_is_better(name) else min
            index = values.index(pick(values))
            out[name] = (steps[index], values[index])
    return out


def _metrics_text(metrics: dict[str, tuple[int, float]]) -> str:
    return "; ".join(f"{name} {number(value)} (step {step})" for name, (step, value) in metrics.items()) or "none"


def throughput_text(run: RunData) -> str:
    parts = []
    for key, unit in (("samples_per_second", "samples/s"), ("tokens_per_second", "tokens/s"), ("mfu", "MFU")):
        _, values = run.series(key)
        if values:
            median = statistics.median(values)
            parts.append(f"{median * 100:.1f}% MFU" if key == "mfu" else f"{number(round(median, 1))} {unit}")
    if not parts:
        return "not logged (add ThroughputCallback, or run through trainer-ext train)"
    return "median " + ", ".join(parts) + ("" if run.series("mfu")[1] else " (MFU: no known peak for this device)")


def saved_text(run: RunData) -> str:
    saved = [name for name in MODEL_FILES if (run.path / name).is_file()]
    complete = [c for c in run.checkpoints if c.path is not None and c.complete]
    newest = f"; newest complete checkpoint: {complete[-1].path}" if complete else ""
    if not saved:
        return f"no final model in {run.path} yet{newest or '; no complete checkpoint either'}"
    merged = f" (merged model: {run.path / 'merged'})" if (run.path / "merged").is_dir() else ""
    return f"{run.path.resolve()} ({', '.join(saved)}){merged}{newest}"


def _train_command(argv: list[str], output_dir: Path) -> str | None:
    """The ``trainer-ext train`` command that resumes this run, from the recorded command line, or None."""
    if len(argv) < 2 or argv[1] != "train" or os.path.basename(argv[0]) not in ("trainer-ext", "__main__.py"):
        return None
    flags, skip = [], False
    for i, word in enumerate(argv[2:]):
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in ("--resume_from_checkpoint", "--resume-from-checkpoint"):
            skip = "=" not in word
            continue
        if name in ("--overwrite_output_dir", "--overwrite-output-dir"):
            following = argv[2 + i + 1] if 2 + i + 1 < len(argv) else ""
            skip = "=" not in word and following.lower() in ("true", "false", "1", "0", "yes", "no")
            continue
        flags.append(word)
    if not any(f.split("=", 1)[0] in ("--output_dir", "--output-dir") for f in flags):
        flags += ["--output_dir", str(output_dir)]
    return shlex.join(["trainer-ext", "train", *flags, "--resume_from_checkpoint", "true"])


def resume_text(run: RunData) -> str:
    complete = [c for c in run.checkpoints if c.path is not None and c.complete]
    if not complete:
        return "no complete checkpoint to resume from (save with --save_strategy steps --save_steps N)"
    command = _train_command(run.last_start().get("argv") or [], run.path.resolve())
    where = f"from {complete[-1].path.name}"
    if command is None:
        command = "the same command with --resume_from_checkpoint true (a Trainer script: trainer.train(resume_from_checkpoint=True))"
    if run.status == "finished":
        return f"finished at step {run.global_step}; to train further raise --max_steps and run: {command} ({where})"
    return f"{command} ({where})"


def status_text(run: RunData) -> str:
    max_steps = run.state.get("max_steps")
    done = f"step {run.global_step}" + (f" of {max_steps}" if max_steps else "")
    return {
        "finished": f"finished ({done})",
        "stopped": f"stopped early at {done} (preemption or a stop request)",
        "interrupted": f"interrupted: last logged {done}, no end recorded (crash or kill)",
        "running": f"still training, at {done} (partial report)",
    }.get(run.status, f"{done} (no event log: not run by trainer-ext train)")


def summary_rows(run: RunData) -> list[tuple[str, str]]:
    """(label, text) rows of the summary table for one run."""
    job, setup = run.job or {}, _setup(run)
    world = setup["world_size"]
    topology = (
        f"{world} process{'es' if world and world > 1 else ''}, {setup['strategy'] or 'strategy unknown'}"
        if world
        else "unknown"
    )
    batch = setup["global_batch"]
    if batch and setup["per_device"] and world:
        batch = f"{batch} samples = {world} × {setup['per_device']} × {setup['accumulation'] or '?'} (processes × per device × accumulation)"
    tokens = run.tokens_at([run.global_step])
    steps = f"{run.global_step:,}" + (f" of {run.state['max_steps']:,}" if run.state.get("max_steps") else "")
    steps += f", epoch {run.state['epoch']:.2f}" if isinstance(run.state.get("epoch"), (int, float)) else ""
    if tokens:
        steps += f", {number(round(tokens[0]))} tokens seen"
    wall = duration(run.wall_seconds)
    if len(run.segments) > 1:
        wall += f" over {len(run.segments)} sessions ({len(run.resumes)} resume{'s' if len(run.resumes) != 1 else ''})"
    best = best_metrics(run)
    best_text = _metrics_text(best)
    if run.state.get("best_model_checkpoint"):
        best_text += f"; best checkpoint: {run.state['best_model_checkpoint']}"
    return [
        ("run folder", str(run.path.resolve())),
        ("status", status_text(run)),
        ("model", model_text(run)),
        ("data", data_text(run)),
        ("task", job.get("task") or "unknown"),
        ("world size and strategy", topology),
        ("precision", _precision(setup["precision"])),
        (
            "global batch",
            str(batch) if batch else f"unknown (per-device batch {run.state.get('train_batch_size', '?')})",
        ),
        ("steps", steps),
        ("wall time", wall),
        ("throughput", throughput_text(run)),
        ("final metrics", _metrics_text(final_metrics(run))),
        ("best metrics", best_text),
        ("model saved in", saved_text(run)),
        ("how to resume", resume_text(run)),
    ]
