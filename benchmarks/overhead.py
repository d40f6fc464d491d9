"""Framework overhead: the same model, data and steps trained by a plain PyTorch loop and by the Trainers.

    python benchmarks/overhead.py [--steps 60] [--warmup 10] [--json out.json]

Each runner does the same work per optimizer step (forward, backward, clip to 1.0, AdamW, linear LR
schedule, zero_grad) on the same batches; steps/s is timed after ``warmup`` steps, in this one
process, and reported as a ratio to the plain loop. transformers' stock Trainer runs only when
accelerate happens to be installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, get_linear_schedule_with_warmup

SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, seq=64, batch=8),
    "small": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, seq=128, batch=8
    ),
}


def build(size: str, n_samples: int, seed: int = 0) -> tuple[LlamaForCausalLM, Dataset, dict[str, Any]]:
    spec = dict(SIZES[size])
    seq, batch = spec.pop("seq"), spec.pop("batch")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1024, max_position_embeddings=seq, num_key_value_heads=spec["num_attention_heads"], **spec
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (n_samples, seq), generator=g)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}).with_format("torch")
    return model, data, {"seq": seq, "batch": batch}


class _Clock(TrainerCallback):
    """Timestamps optimizer steps inside the Trainer (no host sync added)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end, self.first = warmup, None, None, None
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if state.global_step == 1:
            self.first = now - self.t0
        if state.global_step == self.warmup:
            self.start = now
        self.end = now


def run_plain(size: str, steps: int, warmup: int) -> dict[str, float]:
    model, data, shape = build(size, steps * SIZES[size]["batch"])
    t0 = time.perf_counter()
    loader = torch.utils.data.DataLoader(data, batch_size=shape["batch"], shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, steps)
    model.train()
    start = first = None
    for step, batch in enumerate(loader, start=1):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        if step == 1:
            first = now - t0
        if step == warmup:
            start = now
    end = time.perf_counter()
    return {"steps_per_s": (steps - warmup) / (end - start), "first_step_s": first}


def run_trainer(trainer_cls: type, args_cls: type, size: str, steps: int, warmup: int, out: Path) -> dict[str, float]:
    model, data, shape = build(size, steps * SIZES[size]["batch"])
    clock = _Clock(warmup)
    args = args_cls(
        output_dir=str(out),
        per_device_train_batch_size=shape["batch"],
        max_steps=steps,
        learning_rate=1e-4,
        weight_decay=0.0,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        optim="adamw_torch",  # the same torch.optim.AdamW as the plain loop (the default is the fused kernel)
        logging_steps=steps,  # one log at the end, as a real run logs every few hundred steps
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=[clock])
    trainer.train()
    return {"steps_per_s": (steps - warmup) / (clock.end - clock.start), "first_step_s": clock.first}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs per runner")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/overhead"))
    opts = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    t0 = time.perf_counter()
    import trainer_ext
    from trainer_ext import Trainer, TrainingArguments

    import_s = time.perf_counter() - t0
    runners = {
        "plain PyTorch loop": lambda: run_plain(opts.size, opts.steps, opts.warmup),
        "trainer_ext.Trainer": lambda: run_trainer(
            Trainer, TrainingArguments, opts.size, opts.steps, opts.warmup, opts.out
        ),
    }
    if importlib.util.find_spec("accelerate") is not None:
        import transformers

        runners["transformers.Trainer (stock)"] = lambda: run_trainer(
            transformers.Trainer, transformers.TrainingArguments, opts.size, opts.steps, opts.warmup, opts.out
        )
    results: dict[str, Any] = {}
    for _ in range(opts.repeats):  # interleaved, best of N: fair against machine noise
        for name, runner in runners.items():
            r = runner()
            if name not in results or r["steps_per_s"] > results[name]["steps_per_s"]:
                results[name] = r
    base = results["plain PyTorch loop"]["steps_per_s"]
    print(f"size={opts.size} steps={opts.steps} warmup={opts.warmup} repeats={opts.repeats} torch={torch.__version__}")
    print(f"{'runner':32} {'steps/s':>9} {'ratio':>7} {'first step s':>13}")
    for name, r in results.items():
        r["ratio_to_plain"] = r["steps_per_s"] / base
        print(f"{name:32} {r['steps_per_s']:9.2f} {r['ratio_to_plain']:7.3f} {r['first_step_s']:13.3f}")
    print(f"import trainer_ext + Trainer: {import_s:.2f} s (trainer_ext {trainer_ext.__version__})")
    report = {"size": opts.size, "steps": opts.steps, "warmup": opts.warmup, "results": results, "import_s": import_s}
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
