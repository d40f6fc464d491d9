"""Step ``throughput_1b``: a 1.1B Llama-style model (22 layers, hidden 2048, bf16, sequence 2048, batch 4) trained by
trainer_ext.Trainer and by transformers' Trainer, eager and under ``torch.compile``: tokens/s, MFU against the GPU's
dense bf16 peak, peak memory and time to the first step (compilation included).

Each run is a child of ``benchmarks.run`` (its ``trainer`` and ``stock-trainer`` runners: the same work per step), one
at a time on the GPU, recorded as it ends. The dry run trains the ``tiny`` config on the CPU, eager only.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_kit.kit import ChildFailed, Context, has_module

STEPS, WARMUP = 20, 5  # the rate is measured over the last 15 steps, after compilation and the allocator's warm-up
SLOWER_THAN_STOCK = 0.95  # ours below this fraction of stock's tokens/s is a problem (one run each: GPU noise ~1%)
MFU_TARGET = 0.5  # benchmarks/README.md: >= 50 % MFU compiled on an H100-class GPU


def plan(ctx: Context) -> list[tuple[str, str, bool, float]]:
    """(label, runner, compiled, timeout) in the order they run: eager first (cheap), then compiled."""
    runs = [("ours eager", "trainer", False, 90.0), ("stock eager", "stock-trainer", False, 90.0)]
    if not ctx.dry_run:  # compiling even the tiny model costs the CPU a minute; the flag's path is the same
        runs += [("ours compiled", "trainer", True, 150.0), ("stock compiled", "stock-trainer", True, 120.0)]
    return runs


def run(ctx: Context) -> None:
    config = "tiny" if ctx.dry_run else "gpu-1b"
    steps, warmup = (6, 2) if ctx.dry_run else (STEPS, WARMUP)
    ctx.record(config=config, steps=steps, warmup=warmup)
    results: dict[str, dict[str, Any]] = {}
    for label, runner, compiled, timeout in plan(ctx):
        if runner.startswith("stock") and not has_module("accelerate"):
            ctx.note(f"{label}: transformers' Trainer needs accelerate, which is not installed here")
            continue
        args = ["-m", "benchmarks.run", "--child", runner, "--config", config, "--steps", str(steps)]
        args += ["--warmup", str(warmup), "--bf16" if ctx.cuda else "--no-bf16"]
        args += (["--torch_compile"] if compiled else []) + ([] if ctx.cuda else ["--cpu"])
        try:
            result = ctx.python(args, timeout=timeout, label=label)
        except ChildFailed as exc:
            ctx.problem(f"{label} failed: {str(exc)[-1500:]}")
            continue
        key = label.replace(" ", "_")
        results[key] = result
        ctx.record(**{key: result})
    for mode in ("eager", "compiled"):
        ours, stock = results.get(f"ours_{mode}"), results.get(f"stock_{mode}")
        if ours and stock:
            ratio = ours["tokens_per_s"] / stock["tokens_per_s"]
            ctx.record(**{f"{mode}_speed_ratio": ratio, f"{mode}_memory_ratio": ours["peak_memory_mb"]
                          / stock["peak_memory_mb"]})  # fmt: skip
            if ctx.cuda:
                ctx.check(ratio >= SLOWER_THAN_STOCK, f"{mode}: ours at {ratio:.3f} of stock's tokens/s")
    compiled = results.get("ours_compiled")
    if compiled and results.get("ours_eager"):
        ctx.record(compile_speedup=compiled["tokens_per_s"] / results["ours_eager"]["tokens_per_s"])
    if ctx.cuda and compiled and compiled.get("mfu") is not None:
        ctx.check(compiled["mfu"] >= MFU_TARGET, f"compiled MFU {100 * compiled['mfu']:.1f}% < the 50% target")


def summarize(f: dict[str, Any]) -> list[str]:
    lines = [f"config {f.get('config')}, {f.get('steps')} steps ({f.get('warmup')} warm-up)"]
    for key in ("ours_eager", "stock_eager", "ours_compiled", "stock_compiled"):
        r = f.get(key)
        if r:
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
            lines.append(
                f"{key.replace('_', ' ')}: {r['tokens_per_s']:.0f} tokens/s, MFU {mfu}, peak {r['peak_memory_mb']:.0f}"
                f" MiB, first step {r['first_step_s']:.1f} s"
            )
    for mode in ("eager", "compiled"):
        if f"{mode}_speed_ratio" in f:
            lines.append(
                f"{mode} ours vs stock: speed {f[f'{mode}_speed_ratio']:.3f}x, memory {f[f'{mode}_memory_ratio']:.3f}x"
            )
    if "compile_speedup" in f:
        lines.append(f"torch.compile speed-up (ours): {f['compile_speedup']:.2f}x")
    return lines
