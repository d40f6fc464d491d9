"""Distributed strategies: the framework's cost over the raw engine, for DDP, FSDP2 and DeepSpeed ZeRO.

    python -m benchmarks.strategies [--config tiny] [--nproc 2] [--strategies ddp,fsdp,zero2,zero3]
                                    [--steps N] [--repeats R] [--count_calls] [--json out.json]

For each strategy the same model and batches are trained by a hand-written loop on the raw engine (the
reference: torch ``DistributedDataParallel``, FSDP2 ``fully_shard`` per decoder layer, or
``deepspeed.initialize``), by ``trainer_ext.Accelerator``, by ``trainer_ext.Trainer`` and, where accelerate is
installed, by transformers' own Trainer with the same settings (``stock-trainer``), each in its own
``torch.distributed.run`` launch on CPU/gloo (CUDA/NCCL when present and ``--cpu`` is not given). Every
runner does the same work per optimizer step: forward, backward, clip to 1.0, AdamW, linear LR schedule.
The table gives steps/s (with its spread over the repeats: the noise), the ratio to the raw loop of the same
strategy, the CPU time all ranks spent per step (``time.process_time``, the least over the repeats) with the raw
loop's over it (``cpu ratio``: the work a framework adds, waiting excluded; on a shared 2-core machine it moves with
the load much as the rate does), and the peak resident memory of the largest rank. The ratio is the framework's overhead; across
strategies, compare memory, not speed (on CPU the sharded engines pay for communication that DDP does not). ``--count_calls`` lists instead what each runner
calls per step that can make a rank wait (collectives, host reads of tensors: ``benchmarks/step_calls.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.run import (  # noqa: E402
    CONFIGS,
    FSDP_PRESET,
    STOCK_FSDP_CONFIG,
    STOCK_FSDP_ON_CPU,
    _Clock,
    _model_and_data,
    _sync_fn,
    accelerator_loop,
    best_of_interleaved,
    check_stock_fsdp,
    child_args,
    child_env,
    has_cuda,
    hf_param_groups,
    last_json,
    peak_memory_mb,
    shard_model,
    spread_text,
    tick_callback,
    torchrun_args,
    trainer_arguments,
)

STRATEGIES = ("ddp", "fsdp", "zero2", "zero3")
FRAMEWORKS = ("raw", "raw-hf", "accelerator", "trainer", "stock-trainer")
DS_PRESETS = {
    "zero2": ROOT / "configs" / "deepspeed" / "zero2.json",
    "zero3": ROOT / "configs" / "deepspeed" / "zero3.json",
}


def _raw_deepspeed_config(strategy: str, cfg: dict[str, Any], world: int, bf16: bool) -> dict[str, Any]:
    """The strategy's preset with every ``"auto"`` written out as trainer_ext resolves it for this run.

    The raw loop must run the same DeepSpeed config as the frameworks, or the ratio measures the config: the
    ``"auto"`` bucket sizes follow transformers' convention (hidden size squared), which on a tiny model means
    one all-reduce per parameter instead of DeepSpeed's default of one per step.
    """
    h = cfg["hidden_size"]
    values = {
        "train_micro_batch_size_per_gpu": cfg["batch"],
        "gradient_accumulation_steps": 1,
        "train_batch_size": cfg["batch"] * world,
        "gradient_clipping": 1.0,
        "fp16.enabled": False,
        "bf16.enabled": bf16,
        "zero_optimization.reduce_bucket_size": h * h,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * h * h),
        "zero_optimization.stage3_param_persistence_threshold": 10 * h,
    }

    def fill(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                out[key] = fill(value, path + ".")
            elif value == "auto":
                out[key] = values[path]  # a KeyError names an "auto" this benchmark does not know yet
            else:
                out[key] = value
        return out

    config = fill(json.loads(DS_PRESETS[strategy].read_text()))
    config["zero_allow_untested_optimizer"] = True  # a torch AdamW, as the frameworks pass it
    config["steps_per_print"] = 10**9
    return config


def _fused(strategy: str, device: Any) -> bool:
    """Fused AdamW on CUDA, as every runner of benchmarks.run uses; DeepSpeed keeps the plain one."""
    return device.type == "cuda" and not strategy.startswith("zero")


def _loader(data: Any, batch: int, rank: int, world: int) -> Any:
    """Rank ``rank``'s share of the batches: as many batches of the same size as the frameworks' loaders give it."""
    import torch

    sampler = torch.utils.data.distributed.DistributedSampler(data, world, rank, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler)


def _token_count(batch: dict[str, Any]) -> dict[str, Any]:
    """transformers' loss normalisation: the labels counted over every rank (an all-reduce), the loss scaled back."""
    import torch.distributed as dist

    items = batch["labels"][..., 1:].ne(-100).sum()
    dist.all_reduce(items)
    return {"num_items_in_batch": items}


def run_raw(
    strategy: str, cfg: dict[str, Any], steps: int, warmup: int, device: Any, bf16: bool, hf_rules: bool = False
) -> _Clock:
    """The reference: a hand-written loop straight on the engine, no trainer_ext. ``hf_rules`` adds what
    transformers' Trainer does by its own rules: the loss normalised by the token count of every rank
    (``average_tokens_across_devices``) and the optimizer's two parameter groups."""
    import torch
    import torch.distributed as dist
    from transformers import get_linear_schedule_with_warmup

    clock = _Clock(warmup)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, data = _model_and_data(cfg, steps * cfg["batch"] * world)
    model.to(device).train()
    loader = _loader(data, cfg["batch"], rank, world)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and strategy in ("ddp", "fsdp"))
    if strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    elif strategy == "fsdp":
        shard_model(model, bf16)
        autocast = torch.autocast(device.type, enabled=False)
    params = hf_param_groups(model) if hf_rules else model.parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=_fused(strategy, device))
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, steps)
    if strategy.startswith("zero"):
        import deepspeed

        config = _raw_deepspeed_config(strategy, cfg, world, bf16)
        model, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            extra = _token_count(batch) if hf_rules else {}
            loss = model(**batch, **extra).loss * (world if hf_rules else 1)
            model.backward(loss)
            model.step()  # clips, steps the optimizer and the scheduler, zeroes the gradients
            clock.tick(_sync_fn(device))
        return clock
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        extra = _token_count(batch) if hf_rules else {}
        with autocast:
            loss = model(**batch, **extra).loss * (world if hf_rules else 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick(_sync_fn(device))
    return clock


def run_accelerator(strategy: str, cfg: dict[str, Any], steps: int, warmup: int, device: Any, bf16: bool) -> _Clock:
    """``trainer_ext.Accelerator`` in the same hand-written loop."""
    clock = _Clock(warmup)
    from trainer_ext import Accelerator

    accelerator = Accelerator(
        cpu=device.type == "cpu",
        mixed_precision="bf16" if bf16 else "no",
        fsdp_config=str(FSDP_PRESET) if strategy == "fsdp" else None,
        deepspeed_config=str(DS_PRESETS[strategy]) if strategy in DS_PRESETS else None,
    )
    model, data = _model_and_data(cfg, steps * cfg["batch"] * accelerator.num_processes)
    accelerator_loop(accelerator, model, data, cfg, steps, clock, device)
    return clock


def run_trainer(
    strategy: str, cfg: dict[str, Any], steps: int, warmup: int, device: Any, bf16: bool, stock: bool = False
) -> _Clock:
    """``trainer_ext.Trainer`` with the strategy's preset, as ``trainer-ext train`` would run it; ``stock``:
    transformers' own Trainer (accelerate underneath) with the same settings, launched the same way."""
    clock = _Clock(warmup)
    if stock:
        from transformers import Trainer, TrainingArguments
    else:
        from trainer_ext import Trainer, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, data = _model_and_data(cfg, steps * cfg["batch"] * world)
    fsdp_config = (STOCK_FSDP_CONFIG if stock else str(FSDP_PRESET)) if strategy == "fsdp" else None
    args = trainer_arguments(
        TrainingArguments,
        cfg,
        steps,
        device,
        bf16,
        optim="adamw_torch_fused" if _fused(strategy, device) else "adamw_torch",
        fsdp="full_shard" if strategy == "fsdp" else "",
        fsdp_config=fsdp_config,
        deepspeed=str(DS_PRESETS[strategy]) if strategy in DS_PRESETS else None,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[tick_callback(clock, device)])
    if stock and strategy == "fsdp":
        check_stock_fsdp(trainer)
    trainer.train()
    return clock


def _child(opts: argparse.Namespace) -> None:
    """One rank of one run; rank 0 prints the result as JSON on its last line."""

    import datasets  # noqa: F401  (imported before the clock, as in benchmarks.run)
    import torch
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and not opts.cpu
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    cfg = CONFIGS[opts.config]
    steps = opts.steps or cfg["steps"]
    bf16 = opts.bf16 if opts.bf16 is not None else use_cuda
    framework, strategy = opts.child.split(":")
    counter = None
    if opts.count_calls:
        from benchmarks.step_calls import CallCounter

        counter = CallCounter()
        counter.install()
        _Clock.observer = counter.on_tick
    runner = {
        "raw": run_raw,
        "raw-hf": lambda *a: run_raw(*a, hf_rules=True),
        "accelerator": run_accelerator,
        "trainer": run_trainer,
        "stock-trainer": lambda *a: run_trainer(*a, stock=True),
    }[framework]
    clock = runner(strategy, cfg, steps, opts.warmup, device, bf16)
    peak = peak_memory_mb(device if use_cuda else "cpu")
    peak_t = torch.tensor([peak], device=device if use_cuda else "cpu")
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    cpu_t = torch.tensor([clock.cpu_per_step()], dtype=torch.float64, device=peak_t.device)
    dist.all_reduce(cpu_t)  # every rank's CPU time per step, summed
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        rate = clock.rate()
        result = {
            "steps_per_s": rate,
            "tokens_per_s": rate * cfg["batch"] * cfg["seq"] * world,
            "first_step_s": clock.first,
            "peak_memory_mb": float(peak_t.item()),
            "cpu_s_per_step": float(cpu_t.item()),
            "device": torch.cuda.get_device_name() if use_cuda else "cpu",
        }
        if counter is not None:
            result["calls_per_step"] = counter.per_step()
        print(json.dumps(result), flush=True)
    dist.barrier()
    # a gloo group still alive at interpreter exit can abort the process ("terminate called without an active
    # exception"): every runner, the raw loops included, lets go of it here (DeepSpeed's references too)
    from trainer_ext.distributed.state import destroy_process_group

    destroy_process_group()


def _launch(name: str, opts: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, *torchrun_args(opts.nproc), *child_args("benchmarks.strategies", name, opts)]
    if opts.count_calls:
        cmd.append("--count_calls")
    env = child_env()
    env.setdefault("DS_ACCELERATOR", "cpu" if opts.cpu or not has_cuda() else "cuda")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // opts.nproc)))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"runner {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return last_json(proc.stdout)


def _count_calls(names: list[str], opts: argparse.Namespace) -> dict[str, Any]:
    """``--count_calls``: each runner once, its collectives and host reads per optimizer step on rank 0."""
    results = {name: _launch(name, opts)["calls_per_step"] for name in names}
    print(
        f"calls per optimizer step on rank 0 ({opts.nproc} ranks, config={opts.config}; 'item (cpu)': no device wait)"
    )
    for name, calls in results.items():
        framework, strategy = name.split(":")
        listed = ", ".join(f"{call} {n:g}" for call, n in calls.items()) or "none"
        print(f"{strategy:6} {framework:13} {listed}")
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps({"ranks": opts.nproc, "calls_per_step": results}, indent=1))
    return {"calls_per_step": results}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks) per run")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="subset of " + ", ".join(STRATEGIES))
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="subset of " + ", ".join(FRAMEWORKS))
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the config's)")
    parser.add_argument("--warmup", type=int, default=10, help="steps excluded from the rate")
    parser.add_argument("--repeats", type=int, default=1, help="best of N interleaved runs per runner")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even with GPUs")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="default: on for CUDA")
    parser.add_argument(
        "--count_calls",
        action="store_true",
        help="count collectives and host reads per step (rank 0) instead of timing: see benchmarks/step_calls.py",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        _child(opts)
        return {}
    strategies = [s.strip() for s in opts.strategies.split(",") if s.strip()]
    frameworks = [f.strip() for f in opts.frameworks.split(",") if f.strip()]
    unknown = sorted(set(strategies) - set(STRATEGIES)) + sorted(set(frameworks) - set(FRAMEWORKS))
    if unknown:
        parser.error(f"unknown strategy or framework: {', '.join(unknown)}")
    if any(s.startswith("zero") for s in strategies):
        if importlib.util.find_spec("deepspeed") is None:
            print("deepspeed is not installed: skipping zero2/zero3 (pip install -e '.[deepspeed]')")
            strategies = [s for s in strategies if not s.startswith("zero")]
    if "stock-trainer" in frameworks and importlib.util.find_spec("accelerate") is None:
        print("accelerate is not installed: skipping transformers' own Trainer (stock-trainer)")
        frameworks = [f for f in frameworks if f != "stock-trainer"]
    names = [f"{f}:{s}" for s in strategies for f in frameworks]
    if "stock-trainer:fsdp" in names and (opts.cpu or not has_cuda()):
        print(f"skipping stock-trainer under fsdp: {STOCK_FSDP_ON_CPU}")
        names.remove("stock-trainer:fsdp")
    if opts.count_calls:
        return _count_calls(names, opts)
    results = best_of_interleaved(names, opts.repeats, lambda name: _launch(name, opts))
    cfg = CONFIGS[opts.config]
    device = next(iter(results.values()))["device"] if results else "-"
    print(
        f"config={opts.config} ({cfg['layers']}x{cfg['hidden_size']}, seq {cfg['seq']}, batch {cfg['batch']} per "
        f"rank) ranks={opts.nproc} device={device} steps={opts.steps or cfg['steps']} warmup={opts.warmup} "
        f"best of {opts.repeats}"
    )
    print(
        f"{'strategy':9} {'runner':13} {'steps/s':>8} {'spread':>6} {'tokens/s':>10} {'ratio':>6} {'vs hf':>6} "
        f"{'cpu ms/step':>11} {'cpu ratio':>9} {'peak MB/rank':>13}"
    )
    for name, r in results.items():
        framework, strategy = name.split(":")
        base = results.get(f"raw:{strategy}")
        r["ratio_to_raw"] = r["steps_per_s"] / base["steps_per_s"] if base else None
        ratio = f"{r['ratio_to_raw']:.3f}" if base else "-"
        # the Trainer follows transformers' rules (token-count loss, two parameter groups): raw-hf does that too
        hf = results.get(f"raw-hf:{strategy}") if framework.endswith("trainer") else None
        r["ratio_to_raw_hf"] = r["steps_per_s"] / hf["steps_per_s"] if hf else None
        vs_hf = f"{r['ratio_to_raw_hf']:.3f}" if hf else "-"
        # CPU time of all ranks per step: the raw loop's over this runner's (1 = no extra work; >1 = less)
        r["cpu_ratio_to_raw"] = base["cpu_s_per_step"] / r["cpu_s_per_step"] if base else None
        cpu_ratio = f"{r['cpu_ratio_to_raw']:.3f}" if base else "-"
        print(
            f"{strategy:9} {framework:13} {r['steps_per_s']:8.2f} {spread_text(r):>6} {r['tokens_per_s']:10.0f} "
            f"{ratio:>6} {vs_hf:>6} {1000 * r['cpu_s_per_step']:11.1f} {cpu_ratio:>9} {r['peak_memory_mb']:13.0f}"
        )
    report = {"config": opts.config, "ranks": opts.nproc, "device": device, "results": results}
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
