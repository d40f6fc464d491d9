"""The summary table at the top of the report: what the run was, how far it got, what it reached, where it is."""

from __future__ import annotations

import os
import shlex
import statistics
from pathlib import Path
from typing import Any

from trainer_ext.checkpointing import marker as markers
from trainer_ext.checkpointing.verification import check_safetensors
from trainer_ext.report.bounds import MAX_METRICS
from trainer_ext.report.reading import Unreadable, optional_object, read_json
from trainer_ext.report.run import EVAL_SPEED, RunData, _finite
from trainer_ext.values import FALSE_WORDS, TRUE_WORDS

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


def higher_is_better(name: str, run: RunData | None = None) -> bool:
    """The run's own rule for its ``metric_for_best_model`` (``greater_is_better``, else transformers' default:
    higher unless the name ends in ``loss``) when recorded; otherwise judged by the metric's name."""
    chosen, greater = best_model_rule(run) if run is not None else (None, None)
    if chosen is not None and name == chosen:
        return greater if greater is not None else not chosen.endswith("loss")
    return any(word in name for word in HIGHER_IS_BETTER) and "loss" not in name


def best_model_rule(run: RunData) -> tuple[str | None, bool | None]:
    """(eval metric name, greater_is_better) from the run's recorded arguments: the start event, the job, or
    ``training_args`` in trainer_state.json; (None, None) when none records ``metric_for_best_model``."""
    sources = [run.last_start(), run.job or {}, run.state.get("training_args") or {}, run.state.get("args") or {}]
    for source in sources:
        if not isinstance(source, dict):
            continue
        metric = source.get("metric_for_best_model")
        if isinstance(metric, str) and metric:
            greater = source.get("greater_is_better")
            name = metric if metric.startswith("eval_") or metric == "loss" else f"eval_{metric}"
            return name, greater if isinstance(greater, bool) else None
    return None, None


def _safetensors_params(path: Path) -> int:
    """Parameters in one safetensors file, from its header (read by safetensors; no tensor is loaded)."""
    total = 0
    for name, info in check_safetensors(path).items():
        if name != "__metadata__":
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
    return total


def _params(folder: Path) -> tuple[int, bool] | None:
    """(parameter count, is an adapter) of the model saved in ``folder``: one safetensors file, or the shards a
    ``model.safetensors.index.json`` names (their headers summed); None when there is none or it cannot be read."""
    try:
        for name, adapter in (("model.safetensors", False), ("adapter_model.safetensors", True)):
            if (folder / name).is_file():
                return _safetensors_params(folder / name), adapter
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            shards = sorted({v for v in weight_map.values() if isinstance(v, str)})
            if not shards or any(Path(shard).name != shard for shard in shards):
                return None
            return sum(_safetensors_params(folder / shard) for shard in shards), False
    except (markers.CheckpointError, Unreadable, OSError, ValueError, AttributeError, TypeError):
        return None
    return None


def model_text(run: RunData) -> str:
    job = run.job or {}
    name = job.get("model_name_or_path") or (
        f"{job['model_config']} (from scratch)" if job.get("model_config") else None
    )
    config = {}
    for folder in [run.path] + [c.path for c in reversed(run.checkpoints) if c.path is not None]:
        if (folder / "config.json").is_file():
            config = optional_object(folder / "config.json")
            break
    config = config if isinstance(config, dict) else {}
    parts = [name] if name else []
    architectures = config.get("architectures")
    kind = architectures[0] if isinstance(architectures, list) and architectures else config.get("model_type")
    if isinstance(kind, str) and kind:
        parts.append(kind)
    found = _params(run.path)
    if found and found[0]:
        parts.append(f"{found[0] / 1e6:.2f} M parameters" + (" (adapter)" if found[1] else ""))
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
    marker = {
        k: v
        for k, v in marker.items()
        if k not in ("world_size", "global_batch_size", "micro_batch_size") or (type(v) is int and v > 0)
    }
    marker["strategy"] = marker.get("strategy") if isinstance(marker.get("strategy"), str) else None
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
    # train()'s last evaluation, of the model it saved (the best checkpoint's with --load_best_model_at_end), with the
    # few values it adds (the baseline, perplexity)
    for name, value in run.results.items():
        if name.startswith("eval_") and name not in EVAL_SPEED and _finite(value):
            out[name] = (run.global_step, float(value))
    return out


def best_metrics(run: RunData) -> dict[str, tuple[int, float]]:
    """The best value of each eval metric (and of the training loss) with its step."""
    out: dict[str, tuple[int, float]] = {}
    for name in ["loss", *run.eval_metric_names()]:
        steps, values = run.series(name) if name == "loss" else run.eval_series(name)
        if values:
            pick = max if higher_is_better(name, run) else min
            index = values.index(pick(values))
            out[name] = (steps[index], values[index])
    return out


def _metrics_text(metrics: dict[str, tuple[int, float]]) -> str:
    """The metrics as text, the first MAX_METRICS of them (and how many more)."""
    shown = list(metrics.items())[:MAX_METRICS]
    text = "; ".join(f"{name} {number(value)} (step {step})" for name, (step, value) in shown) or "none"
    return text + (f"; and {len(metrics) - MAX_METRICS:,} more" if len(metrics) > MAX_METRICS else "")


def throughput_text(run: RunData) -> str:
    parts = []
    for key, unit in (("samples_per_second", "samples/s"), ("tokens_per_second", "tokens/s"), ("mfu", "MFU")):
        _, values = run.series(key)
        if values:
            median = statistics.median(values)
            parts.append(
                f"{median * 100:.1f}% MFU"
                if key == "mfu"
                else f"{number(round(median) if median >= 100 else round(median, 1))} {unit}"
            )
    if not parts:
        return "not logged: " + _no_throughput(run)
    return "median " + ", ".join(parts) + ("" if run.series("mfu")[1] else " (MFU: no known peak for this device)")


def _no_throughput(run: RunData) -> str:
    """Why a run has no throughput figures, from what it recorded."""
    lines = len(run.train_logs)
    if not lines:
        return "the run logged no training line (--logging_steps not reached yet, or --logging_strategy no)"
    if run.events:  # a train() job with its report on: ThroughputCallback was attached
        return f"none of its {lines} training log line{'s' if lines > 1 else ''} carries samples/s"
    if run.job:
        return "this train() job ran with --report_plots false, which leaves ThroughputCallback out"
    return "a plain Trainer run: add trainer_ext.callbacks.ThroughputCallback to its callbacks"


def saved_text(run: RunData) -> str:
    saved = [name for name in MODEL_FILES if (run.path / name).is_file()]
    complete = [c for c in run.checkpoints if c.path is not None and c.complete]
    newest = f"; newest complete checkpoint: {complete[-1].path}" if complete else ""
    if not saved:
        return f"no final model in {run.path} yet{newest or '; no complete checkpoint either'}"
    merged = f" (merged model: {run.path / 'merged'})" if (run.path / "merged").is_dir() else ""
    return f"{run.path.resolve()} ({', '.join(saved)}){merged}{newest}"


def is_train_command(argv: list[str]) -> bool:
    """Whether ``argv`` is ``trainer-ext train …`` (or ``python -m trainer_ext train …``)."""
    return len(argv) > 1 and argv[1] == "train" and os.path.basename(argv[0]) in ("trainer-ext", "__main__.py")


def _train_command(argv: list[str], output_dir: Path) -> str | None:
    """The ``trainer-ext train`` command that resumes this run, from the recorded command line, or None."""
    if not is_train_command(argv):
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
            skip = "=" not in word and following.strip().lower() in (*TRUE_WORDS, *FALSE_WORDS)
            continue
        flags.append(word)
    if not any(f.split("=", 1)[0] in ("--output_dir", "--output-dir") for f in flags):
        flags += ["--output_dir", str(output_dir)]
    return shlex.join(["trainer-ext", "train", *flags, "--resume_from_checkpoint", "true"])


def resume_text(run: RunData) -> str:
    complete = [c for c in run.checkpoints if c.path is not None and c.complete]  # resume takes the newest
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
