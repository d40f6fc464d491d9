"""Step ``sharded``: FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 through trainer_ext's Trainer on one launched process.

Each strategy is one ``torch.distributed.run`` launch of ``benchmarks.gpu_kit.sharded_child`` (world size 1, the
repository's preset): a run saving a checkpoint at its midpoint, a fresh run resuming from it, and the two compared
(losses after the resume point, final saved weights: exact expected). A strategy that fails is recorded as a problem
and the next one runs. On CUDA a resume that is not exact is run again in the same launch with ``full_determinism`` and eager
attention, which tells kernel non-determinism from a resume fault.
"""

from __future__ import annotations

import re
import time
from typing import Any

from benchmarks.gpu_kit.kit import ChildFailed, Context, has_module
from benchmarks.gpu_kit.sharded_child import SIZES

STRATEGIES = ("fsdp", "zero2", "zero3")
LAUNCH_S = {"cuda": 60, "cpu": 90}  # one launch's limit (expected: ~20 s on an H100, ~16 s on 2 CPU cores)
# what the mid checkpoint must hold, per strategy (DeepSpeed names its partition files after the rank and dtype)
EXPECTED_FILES = {
    "fsdp": (r"model_sharded/\.metadata", r"model_sharded/__0_0\.distcp", r"optimizer_sharded/\.metadata",
             r"optimizer_sharded/__0_0\.distcp"),
    "zero2": (r"latest", r"global_step\d+/mp_rank_00_model_states\.pt",
              r"global_step\d+/(bf16_)?zero_pp_rank_0_mp_rank_00_optim_states\.pt"),
    "zero3": (r"latest", r"global_step\d+/zero_pp_rank_0_mp_rank_00_model_states\.pt",
              r"global_step\d+/(bf16_)?zero_pp_rank_0_mp_rank_00_optim_states\.pt"),
}  # fmt: skip
STALE_LOCK = "~/.cache/torch_extensions/<py>_cpu/deepspeed_shm_comm/lock"


def _launch(ctx: Context, strategy: str, timeout: float) -> dict[str, Any]:
    args = ["-m", "benchmarks.gpu_kit.sharded_child", strategy, "--work", str(ctx.work / strategy)]
    args += ["--device", ctx.device] + (["--dry_run"] if ctx.dry_run else ["--diagnose"])
    return ctx.torchrun(args, nproc=1, timeout=timeout)


def _sharded_by_engine(strategy: str, found: dict[str, Any], layers: int) -> tuple[bool, str]:
    """Whether the engine really wrapped the model, and what was seen."""
    if strategy == "fsdp":
        ok = found.get("is_fsdp_module") and found.get("all_dtensors") and found.get("fsdp_units") == layers + 1
        seen = f"{found.get('wrapper')}, {found.get('fsdp_units')} FSDP units, DTensors {found.get('all_dtensors')}"
        return bool(ok), seen + f", mesh {found.get('mesh')}"
    stage = int(strategy[-1])
    ok = found.get("is_deepspeed_engine") and found.get("zero_stage") == stage
    if stage == 3:
        ok = ok and found.get("partitioned")
    partitioned = f", partitioned {found.get('partitioned')}" if stage == 3 else ""
    return bool(ok), f"{found.get('wrapper')}, ZeRO stage {found.get('zero_stage')}{partitioned}"


def _record(ctx: Context, strategy: str, found: dict[str, Any], seconds: float) -> bool:
    """The strategy's figures and its problems; whether the resume was exact."""
    from benchmarks.gpu_kit.models import LLAMAS

    layers = LLAMAS["dry" if ctx.dry_run else "sharded"]["num_hidden_layers"]
    files = found["checkpoint_files"]
    sharded, seen = _sharded_by_engine(strategy, found, layers)
    exact = found["exact"]
    ctx.record(**{
        f"{strategy}_launch_s": round(seconds, 1),
        f"{strategy}_train_s": round(found["train_s_a"] + found["train_s_b"], 2),
        f"{strategy}_steps_per_s": round(found["steps_per_s"], 2),
        f"{strategy}_peak_memory_mb": round(found["peak_memory_mb"], 1),
        f"{strategy}_exact": exact,
        f"{strategy}_loss_diff": found["loss_diff"],
        f"{strategy}_weight_diff": found["weight_diff"],
        f"{strategy}_final_tensors": found["final_tensors"],
        f"{strategy}_checkpoint_mb": round(found["checkpoint_mb"], 2),
        f"{strategy}_checkpoint_files": ", ".join(f"{name} ({size} B)" for name, size in files.items()),
        f"{strategy}_sharded": seen,
        f"{strategy}_world_size": found["world_size"],
        f"{strategy}_accelerate_imported": found["accelerate_imported"],
    })  # fmt: skip
    missing = [p for p in EXPECTED_FILES[strategy] if not any(re.fullmatch(p, name) for name in files)]
    ctx.check(not missing, f"{strategy}: the checkpoint lacks {', '.join(missing)} (it holds {', '.join(files)})")
    ctx.check(sharded, f"{strategy}: the model was not sharded by its engine ({seen})")
    ctx.check(found["world_size"] == 1 and found["launched"], f"{strategy}: not a launched process group of one")
    ctx.check(not found["accelerate_imported"], f"{strategy}: trainer_ext's run imported accelerate")
    return exact


def _diagnosis(ctx: Context, strategy: str, found: dict[str, Any]) -> str:
    """What the run with full determinism and eager attention said (CUDA): kernel non-determinism or a resume fault."""
    again = found.get("deterministic")
    if not ctx.cuda or again is None:
        return "fp32 on the CPU should be exact: a resume fault"
    if "error" in again:
        return f"the re-run with full_determinism and eager attention failed: {again['error']}"
    ctx.record(**{
        f"{strategy}_deterministic_exact": again["exact"],
        f"{strategy}_deterministic_loss_diff": again["loss_diff"],
        f"{strategy}_deterministic_weight_diff": again["weight_diff"],
    })  # fmt: skip
    if again["exact"]:
        return "exact with full_determinism and eager attention: kernel non-determinism, not the resume"
    return (
        f"not exact with full_determinism and eager attention either (loss {again['loss_diff']:.3g}, weights "
        f"{again['weight_diff']:.3g}): a resume fault, not kernel non-determinism"
    )


def run(ctx: Context) -> None:
    steps, batch, seq = SIZES[ctx.device]
    ctx.record(model="dry" if ctx.dry_run else "sharded", steps=steps, batch=batch, seq=seq, world_size=1)
    deepspeed = has_module("deepspeed")
    for strategy in STRATEGIES:
        if strategy.startswith("zero") and not deepspeed:
            if ctx.cuda:
                ctx.problem(f"{strategy}: deepspeed is not importable (the kit carries its wheel: install it)")
            else:
                ctx.note(f"{strategy} skipped: deepspeed is not importable here")
            ctx.record(**{f"{strategy}_status": "skipped"})
            continue
        begun = time.perf_counter()
        try:
            found = _launch(ctx, strategy, LAUNCH_S[ctx.device])
        except ChildFailed as exc:
            hint = f" (a stale {STALE_LOCK} hangs DeepSpeed's CPU start)" if "stopped after" in str(exc) else ""
            hint = hint if strategy.startswith("zero") and not ctx.cuda else ""
            ctx.record(**{f"{strategy}_status": "failed"})
            ctx.problem(f"{strategy}: the launch failed{hint}:\n{str(exc)[-2000:]}")
            continue
        exact = _record(ctx, strategy, found, time.perf_counter() - begun)
        ctx.record(**{f"{strategy}_status": "exact" if exact else "not exact"})
        if not exact:
            cause = _diagnosis(ctx, strategy, found)
            ctx.problem(
                f"{strategy}: the resume is not exact (losses after step {found['mid']}: max diff "
                f"{found['loss_diff']:.3g}, final weights {found['weight_diff']:.3g}, resumed to step "
                f"{found['resumed_steps']} of {found['steps']}); {cause}"
            )


def summarize(f: dict[str, Any]) -> list[str]:
    lines = [
        f"Llama {f.get('model')!r}, {f.get('steps')} steps of batch {f.get('batch')} x seq {f.get('seq')}, "
        "one process under torch.distributed.run; run A saves mid-way, run B resumes from it"
    ]
    for s in STRATEGIES:
        status = f.get(f"{s}_status")
        if status is None or status in ("skipped", "failed"):
            lines.append(f"{s}: {status or 'not run'}")
            continue
        line = (
            f"{s}: resume {status} (loss diff {f[f'{s}_loss_diff']:.3g}, weight diff {f[f'{s}_weight_diff']:.3g}), "
            f"{f[f'{s}_steps_per_s']} steps/s, peak {f[f'{s}_peak_memory_mb']} MB, checkpoint "
            f"{f[f'{s}_checkpoint_mb']} MB, {f[f'{s}_sharded']}; launch {f[f'{s}_launch_s']} s"
        )
        if f"{s}_deterministic_exact" in f:
            line += f"; with full_determinism: {'exact' if f[f'{s}_deterministic_exact'] else 'not exact'}"
        lines.append(line)
    return lines
