"""Pipeline parallelism: per-rank memory of one process against pp=2, and the step time of each schedule.

    python -m benchmarks.pipeline_parallel [--config small|tiny] [--schedules 1f1b,gpipe,...] [--microbatches M]
                                           [--steps N] [--warmup W] [--json out.json]

The same Llama (built from a config, float32, SDPA, grouped-query attention, untied head) trains the same global
batch for a few optimizer steps through ``trainer_ext.Trainer``: on one process without pipeline parallelism (pp=1),
and, for each schedule, on 2 gloo processes with one thread each given
``TrainingArguments(parallelism_config=ParallelismConfig(pp_size=2, pp_schedule=..., pp_microbatches=...))``, each
run in its own launch (``torch.distributed.run``). Both pipeline ranks read the whole batch, which the schedule cuts
into microbatches. Per run and rank:

- ``stages``: the stage indices the rank holds (2 under the interleaved and zero-bubble schedules, 1 otherwise) and
  their decoder layers (the split balances parameters: the embeddings go with the first stage, norm and head with
  the last).
- ``params MB``: the parameter bytes the rank holds after the split, and its ratio to pp=1's (the whole model);
  ``state MB``: parameters + gradients + AdamW's state. The ranks' parameters must add up to pp=1's exactly.
- ``peak RSS MB``: the resident set's peak from the first step on (sampled every 2 ms; glibc's
  ``MALLOC_MMAP_THRESHOLD_`` fixed so that freed tensors leave the resident set, and the full model every rank builds
  before the split is gone by then); ``train MB``: that peak above the rank's resident set before the model was built.
- ``s/step``: the median step time after the warm-up steps. Informational: on the CPU the 2 ranks share the
  machine's cores and send activations over loopback gloo.
- ``bubble``: the share of a step each rank idles by the schedules' standard model
  (``trainer_ext.distributed.pipeline.schedules.bubble_fraction``: equal stage times, backward = 2 × forward), not
  a measurement.
- ``loss``: the training loss over the steps, which must agree with pp=1's.

The table is printed as markdown; ``--json`` also writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.context_parallel import build_model  # noqa: E402
from benchmarks.parallelism import MMAP_THRESHOLD, RssSampler, _StepTimes, state_bytes  # noqa: E402
from benchmarks.run import child_env, last_json, tick_callback, torchrun_args, trainer_arguments  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    # 10.23M parameters (8 layers of 256, 8 query heads on 2 key/value heads, vocabulary 8192, untied head)
    "small": dict(
        hidden=256, intermediate=768, layers=8, heads=8, kv_heads=2, vocab=8192, seq=128, batch=8, microbatches=4,
        steps=10, warmup=3,
    ),
    # a smoke run in seconds (CI): 4 layers, the fewest the 4 stages of the interleaved schedules take on pp=2
    "tiny": dict(
        hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, vocab=512, seq=32, batch=8, microbatches=4,
        steps=4, warmup=1,
    ),
}  # fmt: skip
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")
PP = 2
MB = 2**20
LOSS_TOLERANCE = 1e-4  # relative: pp=2 sums the microbatches' losses in another order


def _data(cfg: dict[str, Any], n_samples: int) -> Any:
    """``n_samples`` random sequences of the config's length (labels = inputs), the same in every run."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (n_samples, cfg["seq"]), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}).with_format("torch")


def _train(cfg: dict[str, Any], schedule: str | None, opts: argparse.Namespace) -> dict[str, Any]:
    """One rank's run: the Trainer over ``opts.steps`` steps of the global batch; this rank's figures."""
    import torch
    import transformers

    from trainer_ext import ParallelismConfig, Trainer, TrainingArguments
    from trainer_ext.distributed.pipeline import split

    base = RssSampler.current()
    clock, sampler = _StepTimes(opts.warmup), RssSampler()
    model = build_model(cfg, cfg["seq"])
    data = _data(cfg, opts.steps * cfg["batch"])
    config = None
    if schedule is not None:
        config = ParallelismConfig(pp_size=PP, pp_schedule=schedule, pp_microbatches=opts.microbatches)

    class StartSampling(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sampler.start()  # the first call starts it; the model is split by then

    args = trainer_arguments(TrainingArguments, cfg, opts.steps, torch.device("cpu"), False, parallelism_config=config)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        callbacks=[StartSampling(), tick_callback(clock, torch.device("cpu"))],
    )
    output = trainer.train()
    peak = sampler.stop()
    runtime = split.split_of(trainer.model)
    stages, layers = [0], [[0, cfg["layers"]]]
    if runtime is not None:
        stages = list(runtime.stage_ids)
        layers = [list(runtime.ranges[s]) for s in stages]
    return {
        **state_bytes(trainer.model, trainer.optimizer),
        "stages": stages,
        "layers": layers,
        "rss_base": base,
        "rss_peak": peak,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(clock.times) if clock.times else float("nan"),
        "step_times": clock.times,
        "loss": output.training_loss,
    }


def _child(opts: argparse.Namespace) -> None:
    """One process of one run (``1``, or ``2:SCHEDULE``); rank 0 prints every rank's figures as JSON."""
    import datasets  # noqa: F401  (imported before the baseline, as the Trainer needs them)
    import transformers.models.llama.modeling_llama  # noqa: F401

    import trainer_ext  # noqa: F401

    cfg = CONFIGS[opts.config]
    schedule = opts.child.split(":")[1] if ":" in opts.child else None
    mine = _train(cfg, schedule, opts)
    if schedule is None:
        print(json.dumps({"ranks": [mine]}), flush=True)
        return
    import torch.distributed as dist

    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": ranks}), flush=True)
    dist.barrier()
    from trainer_ext.distributed.state import destroy_process_group

    destroy_process_group()


def _launch(schedule: str | None, opts: argparse.Namespace) -> dict[str, Any]:
    """One run in fresh processes: plain Python for pp=1, ``torch.distributed.run`` with 2 for a schedule."""
    launcher = torchrun_args(PP) if schedule else []
    child = f"{PP}:{schedule}" if schedule else "1"
    cmd = [sys.executable, *launcher, "-m", "benchmarks.pipeline_parallel", "--child", child, "--config", opts.config]
    cmd += ["--steps", str(opts.steps), "--warmup", str(opts.warmup), "--microbatches", str(opts.microbatches)]
    env = child_env()
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pp={child} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return last_json(proc.stdout)


def summarize(schedule: str | None, raw: dict[str, Any], microbatches: int, one_params: int) -> dict[str, Any]:
    """One run's figures per rank in MB, with each rank's parameter ratio to pp=1 and the model's bubble."""
    from trainer_ext.distributed.pipeline.schedules import bubble_fraction

    ranks = []
    for rank, r in enumerate(raw["ranks"]):
        ranks.append(
            {
                "rank": rank,
                "stages": r["stages"],
                "layers": r["layers"],
                "params_mb": r["params"] / MB,
                "params_ratio": r["params"] / one_params,
                "state_mb": (r["params"] + r["grads"] + r["optimizer"]) / MB,
                "peak_rss_mb": r["rss_peak"] / MB,
                "train_mb": (r["rss_peak"] - r["rss_base"]) / MB,
                "ru_maxrss_mb": r["ru_maxrss"] / MB,
                "step_s": r["step_s"],
                "step_times": r["step_times"],
                "loss": r["loss"],
            }
        )
    params = [r["params"] for r in raw["ranks"]]
    return {
        "schedule": schedule,
        "pp": len(ranks),
        "microbatches": microbatches if schedule else None,
        "bubble": bubble_fraction(schedule, PP, microbatches) if schedule else 0.0,
        "params_sum": sum(params),
        "params_ratio_max": max(params) / one_params,
        "step_s": max(r["step_s"] for r in ranks),  # a step ends when the slowest rank's does
        "loss": ranks[0]["loss"],
        "ranks": ranks,
    }


def _layers(r: dict[str, Any]) -> str:
    return ", ".join(f"{a}-{b - 1}" for a, b in r["layers"])


def table(runs: list[dict[str, Any]]) -> str:
    """The runs as a markdown table, a row per rank."""
    lines = [
        "| pp | schedule | rank | stages | layers | params MB | ratio to pp=1 | state MB | peak RSS MB | train MB "
        "| s/step | bubble | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for r in run["ranks"]:
            lines.append(
                f"| {run['pp']} | {run['schedule'] or '-'} | {r['rank']} | {','.join(map(str, r['stages']))} "
                f"| {_layers(r)} | {r['params_mb']:.2f} | {r['params_ratio']:.3f} | {r['state_mb']:.1f} "
                f"| {r['peak_rss_mb']:.0f} | {r['train_mb']:.0f} | {r['step_s']:.3f} | {run['bubble']:.3f} "
                f"| {r['loss']:.5f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="subset of " + ", ".join(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=None, help="per step under pp=2 (default: the config's)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the config's)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the step time (the config's)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    cfg = CONFIGS[opts.config]
    opts.steps = opts.steps or cfg["steps"]
    opts.warmup = cfg["warmup"] if opts.warmup is None else opts.warmup
    opts.microbatches = opts.microbatches or cfg["microbatches"]
    if opts.child:
        _child(opts)
        return {}
    schedules = [s.strip() for s in opts.schedules.split(",") if s.strip()]
    unknown = sorted(set(schedules) - set(SCHEDULES))
    if unknown or not schedules:
        parser.error(f"--schedules {opts.schedules}: choose among {', '.join(SCHEDULES)}")
    if opts.steps <= opts.warmup:
        parser.error(f"--steps {opts.steps} leaves no step after --warmup {opts.warmup}: give more steps")
    if opts.microbatches < 1 or cfg["batch"] % opts.microbatches:
        parser.error(f"--microbatches {opts.microbatches}: give a divisor of the global batch, {cfg['batch']}")
    one_raw = _launch(None, opts)
    one_params = one_raw["ranks"][0]["params"]
    runs = [summarize(None, one_raw, opts.microbatches, one_params)]
    runs += [summarize(s, _launch(s, opts), opts.microbatches, one_params) for s in schedules]
    one = runs[0]
    held = True
    for run in runs[1:]:
        run["step_ratio"] = run["step_s"] / one["step_s"]
        run["loss_diff"] = abs(run["loss"] - one["loss"])
        run["partition_held"] = run["params_sum"] == one_params
        run["held"] = (
            run["partition_held"] and run["params_ratio_max"] < 1 and run["loss_diff"] <= LOSS_TOLERANCE * one["loss"]
        )
        held &= run["held"]
    print(
        f"config={opts.config} ({cfg['layers']}x{cfg['hidden']}, {cfg['heads']} heads / {cfg['kv_heads']} kv, vocab "
        f"{cfg['vocab']}, untied, float32, {one_params / 4e6:.2f}M parameters) global batch {cfg['batch']} x "
        f"{cfg['seq']} tokens, {opts.microbatches} microbatches under pp={PP}, steps={opts.steps} "
        f"warmup={opts.warmup}; pp=1: one process; pp={PP}: {PP} gloo processes, OMP_NUM_THREADS=1"
    )
    print(table(runs))
    print()
    print(
        "| schedule | largest rank's params / pp=1 | ranks' params sum to pp=1 | s/step / pp=1 | bubble | loss diff |"
    )
    print("|---|---|---|---|---|---|")
    for run in runs[1:]:
        print(
            f"| {run['schedule']} | {run['params_ratio_max']:.3f} | {'yes' if run['partition_held'] else 'NO'} "
            f"| {run['step_ratio']:.2f} | {run['bubble']:.3f} | {run['loss_diff']:.1e} |"
        )
    verdict = "held for every schedule" if held else "did NOT hold for every schedule"
    print(
        f"\nexpectation: under pp={PP} each rank holds less than the whole model, the ranks' parameters add up to it "
        f"and the loss agrees with pp=1's (relative {LOSS_TOLERANCE:g}): {verdict}"
    )
    report = {
        "config": opts.config,
        "model": cfg,
        "pp": PP,
        "microbatches": opts.microbatches,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "held": held,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "runs": runs,
    }
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
