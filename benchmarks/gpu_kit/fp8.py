"""Step ``fp8``: trainer_ext.Trainer with ``fp8=True`` (torchao float8 Linear layers, dynamic scaling, bf16 autocast
around them) against the same run in bf16, on a small Llama whose dimensions float8 layers accept.

Needs a GPU of compute capability >= 8.9 and torchao; the dry run checks the bf16 side and that the CPU gets
trainer_ext's one-line refusal. The float8 curve must stay within ``FP8_TOLERANCE`` of bf16's.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_kit.kit import ChildFailed, Context, Skip, has_module, rel_diff

# largest relative difference of per-step losses, fp8 vs bf16 (same weights and batches): float8 matmuls with
# dynamic per-tensor scaling move a 20M model's loss by about 1% over 40 steps; 5% means something is wrong
FP8_TOLERANCE = 5e-2


def run(ctx: Context) -> None:
    if ctx.cuda:
        import torch

        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            raise Skip(f"fp8 needs compute capability >= 8.9; this GPU has {capability[0]}.{capability[1]}")
        if not has_module("torchao"):
            ctx.problem("torchao is not installed (benchmarks/gpu_wheels.txt carries it): fp8 not checked")
            return
    size = dict(model="dry", seq=32, batch=4, steps=8, lr=1e-3) if ctx.dry_run else {}
    size = size or dict(model="fp8", seq=256, batch=8, steps=40, lr=1e-3)
    ctx.record(size=size)
    runs = {}
    for precision in ("bf16", "fp8"):
        args = ["-m", "benchmarks.gpu_kit.precision_child", "--framework", "ours", "--precision", precision]
        args += ["--out", str(ctx.work / precision)] + [f"--{k}={v}" for k, v in size.items()]
        try:
            result = ctx.python(args, timeout=120, label=f"ours {precision}")
        except ChildFailed as exc:
            ctx.problem(f"{precision} failed: {str(exc)[-1500:]}")
            continue
        ctx.record(**{precision: result})
        if "refused" in result:
            if ctx.cuda:
                ctx.problem(f"{precision} refused on the GPU: {result['refused']}")
            else:
                ctx.check("compute capability" in result["refused"], f"unexpected refusal: {result['refused']}")
                ctx.note(f"{precision} on the CPU: {result['refused']}")
            continue
        runs[precision] = result
    if "fp8" in runs and "bf16" in runs:
        fp8, bf16 = runs["fp8"], runs["bf16"]
        diff = rel_diff(fp8["losses"], bf16["losses"])
        ctx.record(loss_max_rel_diff=diff, speed_ratio=_ratio(fp8["steps_per_s"], bf16["steps_per_s"]))
        ctx.check(fp8["float8_modules"] > 0, "no Linear layer was converted to float8")
        ctx.check(diff <= FP8_TOLERANCE, f"fp8 loss differs from bf16 by {diff:.3g} relative (> {FP8_TOLERANCE})")
        ctx.check(fp8["losses"][-1] < fp8["losses"][0], f"fp8: the loss did not fall {fp8['losses']}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summarize(f: dict[str, Any]) -> list[str]:
    lines = []
    for precision in ("bf16", "fp8"):
        r = f.get(precision)
        if r and "losses" in r:
            lines.append(
                f"{precision}: loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, {r['steps_per_s'] or 0:.2f} "
                f"steps/s, peak {r['peak_memory_mb']:.0f} MiB, float8 layers {r['float8_modules']}"
            )
    if "loss_max_rel_diff" in f:
        speed = f.get("speed_ratio")
        lines.append(
            f"fp8 vs bf16: loss max rel diff {f['loss_max_rel_diff']:.2e} (tolerance {FP8_TOLERANCE})"
            + (f", speed {speed:.3f}x" if speed else "")
        )
    return lines
