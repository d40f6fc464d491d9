"""One training run of the ``precision`` and ``fp8`` steps: ``--framework ours|stock`` at ``--precision
bf16|fp16|fp8`` (fp8: torchao float8 layers, ours only).

Prints one JSON line: the loss and grad-norm of every step, the optimizer steps the fp16 loss scaler skipped, steps/s
after the warm-up, peak memory, and whether accelerate was imported (ours must not).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.gpu_kit.kit import accelerate_imported, device_memory_mb, emit, has_module, hide_accelerate
from benchmarks.gpu_kit.models import llama, parameter_count, pattern_data

WARMUP = 5


def make_callback(device: Any) -> Any:
    """A callback that notes every optimizer step's time and whether the loss scaler skipped it."""
    import torch
    from transformers import TrainerCallback

    class Watch(TrainerCallback):
        trainer: Any = None

        def __init__(self) -> None:
            self.times: list[float] = []
            self.skipped: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            if getattr(self.trainer.accelerator, "optimizer_step_was_skipped", False):
                self.skipped.append(state.global_step)

    return Watch()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=("ours", "stock"), required=True)
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp8"), required=True)
    parser.add_argument("--model", default="100m")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--out", required=True)
    opts = parser.parse_args(argv)
    if opts.framework == "stock" and not has_module("accelerate"):
        emit({"unavailable": "transformers' Trainer needs accelerate, which is not installed here"})
        return
    if opts.framework == "ours":
        hide_accelerate()  # as where it is not installed: transformers sees none, an import of it by ours fails
    import torch

    if opts.framework == "ours":
        from trainer_ext import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = llama(opts.model, opts.seq, device.type)
    data = pattern_data(opts.steps * opts.batch, opts.seq, model.config.vocab_size)
    watch = make_callback(device)
    try:
        args = TrainingArguments(
            output_dir=opts.out,
            per_device_train_batch_size=opts.batch,
            max_steps=opts.steps,
            learning_rate=opts.lr,
            warmup_steps=opts.steps // 10,
            lr_scheduler_type="linear",
            weight_decay=0.0,
            max_grad_norm=1.0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
            optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
            use_cpu=device.type == "cpu",
            bf16=opts.precision == "bf16",
            fp16=opts.precision == "fp16",
            **({"fp8": True} if opts.precision == "fp8" else {}),
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[watch])
    except Exception as exc:  # e.g. trainer_ext refuses fp16 on the CPU: the step reports the line
        emit({"refused": f"{type(exc).__name__}: {exc}"})
        return
    watch.trainer = trainer
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    history = trainer.state.log_history
    times = watch.times
    scaler = getattr(trainer.accelerator, "scaler", None)
    emit(
        {
            "losses": [h["loss"] for h in history if "loss" in h],
            "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
            "skipped_steps": watch.skipped,
            "final_loss_scale": scaler.get_scale() if scaler is not None else None,
            "steps_per_s": (len(times) - WARMUP) / (times[-1] - times[WARMUP - 1]) if len(times) > WARMUP else None,
            "peak_memory_mb": device_memory_mb(device),
            "parameters": parameter_count(trainer.model),
            "float8_modules": sum("Float8" in type(m).__name__ for m in trainer.model.modules()),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "accelerate_imported": accelerate_imported(),
        }
    )


if __name__ == "__main__":
    main()
