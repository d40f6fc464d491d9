"""Step ``precision``: a ~110M Llama trained in bf16 and in fp16 (GradScaler) by trainer_ext.Trainer and by
transformers' Trainer (through accelerate), each in its own process: loss curves, skipped fp16 steps, steps/s and
peak memory side by side.

The two Trainers start from the same weights and see the same batches, so their curves differ only by what each
framework does; a relative difference above ``CURVE_TOLERANCE`` or a different set of skipped fp16 steps is a problem.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_kit.kit import ChildFailed, Context, rel_diff

# largest relative difference of per-step losses, ours vs stock; same weights and batches, so what remains is
# kernel non-determinism (a few 1e-3 at most over 40 steps in bf16)
CURVE_TOLERANCE = 2e-2
SLOWER_THAN_STOCK = 0.9  # ours below this fraction of stock's steps/s is a problem


def sizes(ctx: Context) -> dict[str, Any]:
    if ctx.dry_run:
        return dict(model="dry", seq=32, batch=4, steps=8, lr=1e-3)
    return dict(model="100m", seq=512, batch=8, steps=40, lr=3e-4)


def run(ctx: Context) -> None:
    size = sizes(ctx)
    ctx.record(size=size)
    for precision in ("bf16", "fp16"):
        runs = {}
        for framework in ("ours", "stock"):
            args = ["-m", "benchmarks.gpu_kit.precision_child", "--framework", framework, "--precision", precision]
            args += ["--out", str(ctx.work / f"{framework}_{precision}")]
            args += [f"--{k}={v}" for k, v in size.items()]
            label = f"{framework} {precision}"
            try:
                result = ctx.python(args, timeout=120, label=label)
            except ChildFailed as exc:
                ctx.problem(f"{label} failed: {str(exc)[-1500:]}")
                continue
            ctx.record(**{f"{framework}_{precision}": result})
            if "refused" in result or "unavailable" in result:
                ctx.note(f"{label}: {result.get('refused') or result.get('unavailable')}")
                break  # nothing to compare the other framework's run with
            if framework == "ours":
                ctx.check(not result["accelerate_imported"], f"{label}: trainer_ext's run imported accelerate")
            ctx.check(result["losses"][-1] < result["losses"][0], f"{label}: the loss did not fall {result['losses']}")
            runs[framework] = result
        if len(runs) == 2:
            compare(ctx, precision, runs["ours"], runs["stock"])
        elif ctx.cuda:
            ctx.problem(f"{precision}: no comparison with transformers' Trainer (a run is missing)")


def compare(ctx: Context, precision: str, ours: dict[str, Any], stock: dict[str, Any]) -> None:
    """Record the side-by-side figures of one precision and flag what is off."""
    diff = rel_diff(ours["losses"], stock["losses"])
    speed = ours["steps_per_s"] / stock["steps_per_s"] if ours["steps_per_s"] and stock["steps_per_s"] else None
    ctx.record(
        **{
            f"{precision}_loss_max_rel_diff": diff,
            f"{precision}_speed_ratio": speed,
            f"{precision}_memory_ratio": ours["peak_memory_mb"] / stock["peak_memory_mb"],
        }
    )
    ctx.check(diff <= CURVE_TOLERANCE, f"{precision}: loss curves differ by {diff:.3g} relative (> {CURVE_TOLERANCE})")
    if precision == "fp16":
        ctx.check(
            ours["skipped_steps"] == stock["skipped_steps"],
            f"fp16: skipped steps differ, ours {ours['skipped_steps']} vs stock {stock['skipped_steps']}",
        )
    if ctx.cuda and speed is not None:
        ctx.check(speed >= SLOWER_THAN_STOCK, f"{precision}: ours runs at {speed:.3f} of stock's steps/s")


def summarize(f: dict[str, Any]) -> list[str]:
    lines = []
    size = f.get("size", {})
    if size:
        lines.append(f"model {size['model']}, seq {size['seq']}, batch {size['batch']}, {size['steps']} steps")
    for precision in ("bf16", "fp16"):
        for framework in ("ours", "stock"):
            r = f.get(f"{framework}_{precision}")
            if not r or "losses" not in r:
                continue
            sps = f"{r['steps_per_s']:.2f}" if r.get("steps_per_s") else "-"
            lines.append(
                f"{precision} {framework}: loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, {sps} steps/s, "
                f"peak {r['peak_memory_mb']:.0f} MiB, skipped steps {r['skipped_steps'] or 'none'}"
            )
        if f"{precision}_loss_max_rel_diff" in f:
            speed = f.get(f"{precision}_speed_ratio")
            lines.append(
                f"{precision} ours vs stock: loss max rel diff {f[f'{precision}_loss_max_rel_diff']:.2e}, speed "
                f"{speed:.3f}x, memory {f[f'{precision}_memory_ratio']:.3f}x"
                if speed
                else f"{precision} ours vs stock: loss max rel diff {f[f'{precision}_loss_max_rel_diff']:.2e}"
            )
    return lines
