"""One strategy of the kit's ``sharded`` step, run under ``torch.distributed.run`` with one process:

    python -m torch.distributed.run --nproc_per_node 1 -m benchmarks.gpu_kit.sharded_child fsdp|zero2|zero3
        --work DIR --device cuda|cpu [--dry_run] [--diagnose]

Run A trains trainer_ext's Trainer under the strategy's preset, saving a checkpoint at the midpoint and the final
model; run B (a fresh Trainer, same seed and initial weights) resumes from A's checkpoint to the end and saves its
final model. Prints one JSON line: both runs' losses after the resume point, the largest weight difference of the
two final models, run A's speed and peak memory, the checkpoint's files, what wrapped the model, and whether
accelerate was imported. With ``--diagnose`` a resume that is not exact is run again with ``full_determinism`` and
eager attention (``deterministic`` in the result), which tells kernel non-determinism from a resume fault.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_kit import models
from benchmarks.gpu_kit.kit import ROOT, accelerate_imported, device_memory_mb, emit, hide_accelerate

PRESETS = {
    "fsdp": ROOT / "configs" / "fsdp" / "full_shard.yaml",
    "zero2": ROOT / "configs" / "deepspeed" / "zero2.json",
    "zero3": ROOT / "configs" / "deepspeed" / "zero3.json",
}
# (optimizer steps, batch, sequence) on the GPU and in the dry run
SIZES = {"cuda": (8, 4, 256), "cpu": (6, 4, 32)}


def _clock(mid: int) -> Any:
    """A callback that keeps the checkpoint at ``mid`` only and notes when each step ended."""
    from transformers import TrainerCallback

    class MidpointOnly(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self.ends.append(time.perf_counter())
            if state.global_step != mid:
                control.should_save = False
            return control

    return MidpointOnly()


def _trainer(
    opts: argparse.Namespace, out: Path, steps: int, batch: int, seq: int, mid: int, deterministic: bool
) -> tuple[Any, Any]:
    import torch

    from trainer_ext import Trainer, TrainingArguments

    device = "cuda" if opts.device == "cuda" else "cpu"
    strategy = {"deepspeed": str(PRESETS[opts.strategy])} if opts.strategy.startswith("zero") else {}
    if opts.strategy == "fsdp":
        strategy = {"fsdp": "full_shard", "fsdp_config": str(PRESETS["fsdp"])}
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=batch,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=mid,
        report_to="none",
        seed=0,
        full_determinism=deterministic,
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=device == "cuda",
        use_cpu=device == "cpu",
        **strategy,
    )
    model = models.llama("dry" if opts.dry_run else "sharded", seq, device, seed=0)
    if deterministic:
        model.set_attn_implementation("eager")
    vocab = model.config.vocab_size
    data = models.pattern_data(steps * batch, seq, vocab)
    torch.manual_seed(0)
    clock = _clock(mid)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[clock]), clock


def _losses(trainer: Any, after: int) -> dict[int, float]:
    return {e["step"]: float(e["loss"]) for e in trainer.state.log_history if "loss" in e and e["step"] > after}


def _saved(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max((float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].numel()), default=0.0)


def _checkpoint_files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _sharding(opts: argparse.Namespace, trainer: Any) -> dict[str, Any]:
    """What wrapped the model: FSDP2's modules and DTensor parameters, or DeepSpeed's engine and its ZeRO stage."""
    wrapped = trainer.model_wrapped
    if opts.strategy == "fsdp":
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        return {
            "wrapper": type(wrapped).__name__,
            "is_fsdp_module": isinstance(wrapped, FSDPModule),
            "fsdp_units": sum(isinstance(m, FSDPModule) for m in wrapped.modules()),
            "all_dtensors": all(isinstance(p, DTensor) for p in wrapped.parameters()),
            "mesh": list(trainer.accelerator.strategy.mesh().shape),
        }
    import deepspeed

    stage = wrapped.zero_optimization_stage() if isinstance(wrapped, deepspeed.DeepSpeedEngine) else None
    found = {"wrapper": type(wrapped).__name__, "is_deepspeed_engine": stage is not None, "zero_stage": stage}
    if stage == 3:  # ZeRO-3 parameters live as partitions (ds_tensor), their own storage emptied
        found["partitioned"] = all(hasattr(p, "ds_tensor") for p in wrapped.module.parameters())
    return found


def _pair(opts: argparse.Namespace, work: Path, deterministic: bool) -> dict[str, Any]:
    """Run A (checkpoint at the midpoint, final model saved) and run B (resumed from it), compared."""
    import torch
    import torch.distributed as dist

    steps, batch, seq = SIZES[opts.device]
    mid = steps // 2
    result: dict[str, Any] = {"steps": steps, "batch": batch, "seq": seq, "mid": mid}
    a_dir, b_dir = work / "a", work / "b"
    first, clock = _trainer(opts, a_dir, steps, batch, seq, mid, deterministic)
    started = time.perf_counter()
    first.train()
    result["train_s_a"] = time.perf_counter() - started
    # the median step, so that neither the first (warm-up) step nor the checkpoint counts
    result["steps_per_s"] = 1 / statistics.median(b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False))
    result["peak_memory_mb"] = device_memory_mb(torch.device(opts.device))
    result["world_size"] = dist.get_world_size() if dist.is_initialized() else None
    result["launched"] = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    result.update(_sharding(opts, first))
    first.save_model(str(a_dir / "final"))
    losses_a = _losses(first, mid)
    checkpoint = a_dir / f"checkpoint-{mid}"
    result["checkpoint_files"] = _checkpoint_files(checkpoint)
    result["checkpoint_mb"] = sum(result["checkpoint_files"].values()) / 2**20
    del first
    if opts.device == "cuda":
        torch.cuda.empty_cache()

    second, _ = _trainer(opts, b_dir, steps, batch, seq, mid, deterministic)
    started = time.perf_counter()
    second.train(resume_from_checkpoint=str(checkpoint))
    result["train_s_b"] = time.perf_counter() - started
    result["resumed_steps"] = second.state.global_step
    second.save_model(str(b_dir / "final"))
    losses_b = _losses(second, mid)
    del second
    result["losses_a"] = [losses_a[s] for s in sorted(losses_a)]
    result["losses_b"] = [losses_b[s] for s in sorted(losses_b)]
    same_steps = sorted(losses_a) == sorted(losses_b) and len(losses_a) == steps - mid
    result["loss_diff"] = max(abs(losses_a[s] - losses_b[s]) for s in losses_a) if same_steps else float("inf")
    final_a, final_b = _saved(a_dir / "final"), _saved(b_dir / "final")
    result["final_tensors"] = len(final_a)
    result["weight_diff"] = _max_diff(final_a, final_b) if final_a else float("inf")
    result["exact"] = result["loss_diff"] == 0.0 and result["weight_diff"] == 0.0 and result["resumed_steps"] == steps
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy", choices=sorted(PRESETS))
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--dry_run", action="store_true")
    parser.add_argument(
        "--diagnose", action="store_true", help="a resume that is not exact runs again with full_determinism"
    )
    opts = parser.parse_args()
    hide_accelerate()  # as where it is not installed: transformers sees none, an import of it by ours fails
    if opts.diagnose:  # set before CUDA starts, so that full_determinism can be switched on later in this process
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    if opts.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = {"strategy": opts.strategy, **_pair(opts, opts.work, deterministic=False)}
    if opts.diagnose and not result["exact"]:
        # last: full_determinism (torch.use_deterministic_algorithms) stays on for the rest of the process
        try:
            again = _pair(opts, opts.work / "deterministic", deterministic=True)
            result["deterministic"] = {k: again[k] for k in ("exact", "loss_diff", "weight_diff", "resumed_steps")}
        except Exception as exc:  # an op without a deterministic kernel, say: the finding is that it could not run
            result["deterministic"] = {"error": f"{type(exc).__name__}: {exc}"[-500:]}
    result["accelerate_imported"] = accelerate_imported()
    emit(result)


if __name__ == "__main__":
    main()
