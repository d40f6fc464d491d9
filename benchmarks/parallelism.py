"""N-D parallelism: per-rank memory and step time of DDP, FSDP2, tensor parallelism and FSDP2 × TP.

    python -m benchmarks.parallelism [--layouts ddp,fsdp,tp,fsdp_tp] [--runners trainer] [--config small]
                                     [--steps N] [--warmup W] [--json out.json]

Each layout trains the same Llama (built from a config, float32, AdamW) on gloo processes with one thread each, in
its own ``torch.distributed.run`` launch. Layouts (``ParallelismConfig`` sizes):

    ddp      4 processes, plain DDP (no parallelism_config): every rank holds everything
    fsdp     4 processes, dp_shard_size=4: FSDP2, everything sharded four ways
    tp       2 processes, tp_size=2: the model's own plan splits its linears and embeddings two ways. Tensor
             parallelism does not compose with pure replication (refused, as accelerate does), so on 4 processes
             it is ``tp4`` or ``fsdp_tp``; the per-rank figures do not depend on the process count
    fsdp_tp  4 processes, dp_shard_size=2 × tp_size=2: TP within pairs, FSDP2 across them
    tp4      4 processes, tp_size=4 (not in the default set)
    hsdp     4 processes, dp_replicate_size=2 × dp_shard_size=2 (not in the default set)

Runners: ``trainer`` (``trainer_ext.Trainer`` with ``TrainingArguments(parallelism_config=...)``), ``accelerator``
(``Accelerator(parallelism_config=...)`` in a hand-written loop) and ``raw`` (the engine's layout applied by hand:
``trainer_ext.distributed.mesh.parallelize`` or torch DDP, the reference). Each prints, per layout:

- ``state MB/rank``: parameters + gradients + optimizer state held by the largest rank (local shards counted from
  the tensors), its ratio to DDP, the ratio the plan predicts and whether the measurement held it (within 5%). The
  prediction is ``(S / tp + R) / (dp_shard × T)``: S the parameters the TP plan splits, R the ones it replicates
  (norms), T all of them; replication saves nothing.
- ``peak RSS MB/rank``: the resident set's peak during training (sampled every 2 ms from the first step on, largest
  rank), and ``train MB``: that peak above the rank's resident set before the model was built (what training holds:
  the state, activations, communication buffers), with its ratio to DDP's and whether it stayed under DDP's and
  within 0.15 of the plan's ratio (``rss held``: the state dominates). The children run with ``MALLOC_MMAP_THRESHOLD_`` fixed so that freed
  tensors go back to the system and the resident set follows the live tensors (the full model every rank builds
  before sharding is gone by the first step).
- ``s/step``: the median step time after the warm-up. On CPU it is informational: the ranks share the machine's
  cores, and TP pays a collective per layer that NVLink hides and loopback gloo does not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.run import (  # noqa: E402
    _Clock,
    _model_and_data,
    child_env,
    last_json,
    tick_callback,
    torchrun_args,
    trainer_arguments,
)

# the Llama of each config: parameters dominate a rank's memory (small batch, short sequences)
CONFIGS: dict[str, dict[str, Any]] = {
    # about 36M parameters (8 layers of 512, vocabulary 8192, untied head): 140 MB of float32 weights
    "small": dict(hidden_size=512, intermediate_size=1536, layers=8, heads=8, vocab=8192, seq=64, batch=2, steps=6),
    # a smoke run in seconds (CI)
    "tiny": dict(hidden_size=128, intermediate_size=256, layers=2, heads=4, vocab=1024, seq=32, batch=2, steps=4),
}
LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "ddp": (4, {}),
    "fsdp": (4, {"dp_shard_size": 4}),
    "tp": (2, {"tp_size": 2}),
    "fsdp_tp": (4, {"dp_shard_size": 2, "tp_size": 2}),
    "tp4": (4, {"tp_size": 4}),
    "hsdp": (4, {"dp_replicate_size": 2, "dp_shard_size": 2}),
}
DEFAULT_LAYOUTS = ("ddp", "fsdp", "tp", "fsdp_tp")
RUNNERS = ("trainer", "accelerator", "raw")
TOLERANCE = 0.05  # measured state ratio within 5% of the predicted one
# training memory (RSS) may exceed the plan's ratio by this much: FSDP2 gathers a layer at a time, activations and
# communication buffers are not sharded; more means the state no longer dominates (as in the tiny config)
RSS_MARGIN = 0.15
MMAP_THRESHOLD = str(128 * 1024)  # glibc: every block from 128 KiB up is its own mapping, returned when freed


class RssSampler:
    """The resident set's peak, read from /proc every ``interval`` seconds by a daemon thread while running."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def current() -> int:
        """This process's resident set now, in bytes."""
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(self.interval)

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            self.peak = self.current()
            self._thread.start()

    def stop(self) -> int:
        """Stop sampling; the peak in bytes."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return max(self.peak, self.current())


def _local_bytes(tensor: Any) -> int:
    """Bytes this rank holds of ``tensor`` (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """Parameters, gradients (one per trainable parameter, laid out as it) and optimizer state held by this rank."""
    import torch

    params = list({id(p): p for p in model.parameters()}.values())
    optimizer = getattr(optimizer, "optimizer", optimizer)  # a framework's wrapper holds torch's optimizer
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p) for p in params if p.requires_grad),
        "optimizer": sum(_local_bytes(v) for v in states),
    }


def predicted_ratio(model: Any, sizes: dict[str, int]) -> float:
    """State per rank against DDP's as the plan predicts: TP splits the plan's modules, FSDP2 everything."""
    from trainer_ext.distributed.mesh.tensor_parallel import model_tp_plan, resolve_plan

    tp, shard = sizes.get("tp_size", 1), sizes.get("dp_shard_size", 1)
    total = sum(p.numel() for p in model.parameters())
    split = 0
    if tp > 1:
        modules = dict(model.named_modules())
        resolved = resolve_plan(model, model_tp_plan(model), strict=False)
        split = sum(
            p.numel() for name, style in resolved.items() if style != "replicate"
            for p in modules[name].parameters(recurse=False)
        )  # fmt: skip
    return (split / tp + (total - split)) / (shard * total)


def _data_parallel(built: Any, config: Any) -> tuple[int, int]:
    """(this rank's data-parallel index, the number of data-parallel ranks): ranks of one TP group share a batch."""
    if built is None or not config.dp_dim_names:
        return 0, 1
    dp = built["dp"]
    return dp.get_local_rank(), dp.size()


def run_raw(cfg: dict[str, Any], sizes: dict[str, int], steps: int, clock: _Clock, sampler: RssSampler) -> Any:
    """The layout applied by hand: ``parallelize`` on the mesh (or torch DDP), clipping across DTensors."""
    import torch
    import torch.distributed as dist

    from trainer_ext.distributed.mesh.compose import parallelize
    from trainer_ext.distributed.mesh.config import ParallelismConfig
    from trainer_ext.distributed.mesh.device_mesh import build_parallel_mesh
    from trainer_ext.distributed.mesh.grad_norm import clip_grad_norm

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model, data = _model_and_data(cfg, steps * cfg["batch"] * world)
    prediction = predicted_ratio(model, sizes)
    config = built = None
    if sizes:
        config = ParallelismConfig(**sizes)
        built = build_parallel_mesh(config, "cpu")
        parallelize(model, built, config)
        clip = clip_grad_norm
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        clip = torch.nn.utils.clip_grad_norm_
    rank, dp_size = _data_parallel(built, config) if sizes else (dist.get_rank(), world)
    sampler_ = torch.utils.data.distributed.DistributedSampler(data, dp_size, rank, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=cfg["batch"], sampler=sampler_)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    model.train()
    sampler.start()
    for step, batch in enumerate(loader):
        if step == steps:
            break
        model(**batch).loss.backward()
        clip(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
    return model, optimizer, prediction


def _parallelism_config(sizes: dict[str, int]) -> Any:
    from trainer_ext import ParallelismConfig

    return ParallelismConfig(**sizes) if sizes else None


def run_trainer(cfg: dict[str, Any], sizes: dict[str, int], steps: int, clock: _Clock, sampler: RssSampler) -> Any:
    """``trainer_ext.Trainer`` given the layout as ``TrainingArguments(parallelism_config=...)``."""
    import torch
    import transformers

    from trainer_ext import Trainer, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, data = _model_and_data(cfg, steps * cfg["batch"] * world)
    prediction = predicted_ratio(model, sizes)

    class StartSampling(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sampler.start()  # the first call starts it; the model is laid out by then

    args = trainer_arguments(
        TrainingArguments, cfg, steps, torch.device("cpu"), False, parallelism_config=_parallelism_config(sizes)
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        callbacks=[StartSampling(), tick_callback(clock, torch.device("cpu"))],
    )
    trainer.train()
    return trainer.model, trainer.optimizer, prediction


def run_accelerator(cfg: dict[str, Any], sizes: dict[str, int], steps: int, clock: _Clock, sampler: RssSampler) -> Any:
    """``Accelerator(parallelism_config=...)`` in the hand-written loop of the other benchmarks."""
    import torch

    from trainer_ext import Accelerator

    accelerator = Accelerator(cpu=True, parallelism_config=_parallelism_config(sizes))
    model, data = _model_and_data(cfg, steps * cfg["batch"] * accelerator.num_processes)
    prediction = predicted_ratio(model, sizes)
    loader = torch.utils.data.DataLoader(data, batch_size=cfg["batch"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    sampler.start()
    for step, batch in enumerate(loader):
        if step == steps:
            break
        accelerator.backward(model(**batch).loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        clock.tick()
    return model, optimizer, prediction


class _StepTimes(_Clock):
    """``_Clock`` that also keeps every step's duration (the median is reported)."""

    def __init__(self, warmup: int) -> None:
        super().__init__(warmup)
        self.times: list[float] = []
        self._last = time.perf_counter()

    def tick(self, sync: Any = None) -> None:
        super().tick(sync)
        now = time.perf_counter()
        if self.steps > self.warmup:
            self.times.append(now - self._last)
        self._last = now


def _child(opts: argparse.Namespace) -> None:
    """One rank of one layout; rank 0 prints the result (every rank's figures gathered) as JSON."""
    import datasets  # noqa: F401  (imported before the baseline, as every runner needs them)
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401

    import trainer_ext  # noqa: F401

    runner, layout = opts.child.split(":")
    sizes = LAYOUTS[layout][1]
    cfg = CONFIGS[opts.config]
    steps = opts.steps or cfg["steps"]
    base = RssSampler.current()
    clock, sampler = _StepTimes(opts.warmup), RssSampler()
    run = {"raw": run_raw, "trainer": run_trainer, "accelerator": run_accelerator}[runner]
    model, optimizer, prediction = run(cfg, sizes, steps, clock, sampler)
    peak = sampler.stop()
    mine = {
        **state_bytes(model, optimizer),
        "rss_base": base,
        "rss_peak": peak,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(clock.times) if clock.times else float("nan"),
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": ranks, "predicted_ratio": prediction}), flush=True)
    dist.barrier()
    from trainer_ext.distributed.state import destroy_process_group

    destroy_process_group()


def _launch(name: str, opts: argparse.Namespace) -> dict[str, Any]:
    nproc = LAYOUTS[name.split(":")[1]][0]
    cmd = [sys.executable, *torchrun_args(nproc), "-m", "benchmarks.parallelism", "--child", name]
    cmd += ["--config", opts.config, "--warmup", str(opts.warmup)]
    if opts.steps:
        cmd += ["--steps", str(opts.steps)]
    env = child_env()
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return last_json(proc.stdout)


def summarize(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The largest rank's figures of one launch, in MB."""
    ranks = raw["ranks"]
    state = max(r["params"] + r["grads"] + r["optimizer"] for r in ranks)
    return {
        "nproc": len(ranks),
        "sizes": LAYOUTS[name.split(":")[1]][1],
        "state_mb": state / 2**20,
        "params_mb": max(r["params"] for r in ranks) / 2**20,
        "optimizer_mb": max(r["optimizer"] for r in ranks) / 2**20,
        "peak_rss_mb": max(r["rss_peak"] for r in ranks) / 2**20,
        "train_mb": max(r["rss_peak"] - r["rss_base"] for r in ranks) / 2**20,
        "ru_maxrss_mb": max(r["ru_maxrss"] for r in ranks) / 2**20,
        "step_s": statistics.median(r["step_s"] for r in ranks),
        "predicted_ratio": raw["predicted_ratio"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="subset of " + ", ".join(LAYOUTS))
    parser.add_argument("--runners", default="trainer", help="subset of " + ", ".join(RUNNERS))
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the config's)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the step time")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        _child(opts)
        return {}
    layouts = [s.strip() for s in opts.layouts.split(",") if s.strip()]
    runners = [s.strip() for s in opts.runners.split(",") if s.strip()]
    unknown = sorted(set(layouts) - set(LAYOUTS)) + sorted(set(runners) - set(RUNNERS))
    if unknown:
        parser.error(f"unknown layout or runner: {', '.join(unknown)}")
    if "ddp" not in layouts:
        layouts.insert(0, "ddp")  # the baseline of every ratio
    steps = opts.steps or CONFIGS[opts.config]["steps"]
    if steps <= opts.warmup:
        parser.error(f"--steps {steps} leaves no step after --warmup {opts.warmup}: give more steps")
    names = [f"{runner}:{layout}" for runner in runners for layout in layouts]
    results = {name: summarize(name, _launch(name, opts)) for name in names}
    cfg = CONFIGS[opts.config]
    print(
        f"config={opts.config} ({cfg['layers']}x{cfg['hidden_size']}, vocab {cfg['vocab']}, seq {cfg['seq']}, batch "
        f"{cfg['batch']} per data-parallel rank) gloo, OMP_NUM_THREADS=1, steps={steps} warmup={opts.warmup}"
    )
    print(
        f"{'runner':11} {'layout':8} {'procs':>5} {'state MB':>9} {'ratio':>6} {'plan':>6} {'held':>4} "
        f"{'peak RSS MB':>11} {'train MB':>9} {'ratio':>6} {'held':>4} {'s/step':>7} {'ratio':>6}"
    )
    held_all = rss_all = True
    for name, r in results.items():
        runner, layout = name.split(":")
        ddp = results[f"{runner}:ddp"]
        r["state_ratio"] = r["state_mb"] / ddp["state_mb"]
        r["held"] = abs(r["state_ratio"] / r["predicted_ratio"] - 1) <= TOLERANCE
        r["train_ratio"] = r["train_mb"] / ddp["train_mb"]
        r["rss_held"] = layout == "ddp" or r["train_ratio"] < min(1.0, r["predicted_ratio"] + RSS_MARGIN)
        r["step_ratio"] = r["step_s"] / ddp["step_s"]
        held_all &= r["held"]
        rss_all &= r["rss_held"]
        print(
            f"{runner:11} {layout:8} {r['nproc']:5d} {r['state_mb']:9.1f} {r['state_ratio']:6.3f} "
            f"{r['predicted_ratio']:6.3f} {'yes' if r['held'] else 'NO':>4} {r['peak_rss_mb']:11.0f} "
            f"{r['train_mb']:9.0f} {r['train_ratio']:6.3f} {'yes' if r['rss_held'] else 'NO':>4} "
            f"{r['step_s']:7.2f} {r['step_ratio']:6.2f}"
        )
    verdict = "held for every layout" if held_all else "did NOT hold for every layout (see the first 'held')"
    print(f"expectation: state per rank = (S/tp + R) / (dp_shard × T) of DDP's (within {TOLERANCE:.0%}): {verdict}")
    verdict = "held for every layout" if rss_all else "did NOT hold for every layout (see the second 'held')"
    print(f"expectation: training RSS below DDP's and within {RSS_MARGIN} of that ratio: {verdict}")
    report = {
        "config": opts.config,
        "steps": steps,
        "warmup": opts.warmup,
        "held": held_all,
        "rss_held": rss_all,
        "results": results,
    }
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
