"""Peak evaluation memory against the eval set size: streamed metrics vs transformers' concatenating path.

    python benchmarks/eval_memory.py [--sizes 64,256,1024] [--vocab 8192] [--seq_len 64] [--json out.json]

Each (path, size) is a fresh process that builds one causal LM, then evaluates it with ``trainer_ext.Trainer``:

* ``streamed``: ``batch_eval_metrics=True`` with ``trainer_ext.metrics`` (perplexity, token accuracy), which add
  every batch to running counts and keep no logits;
* ``stock``: transformers' classic path, every logit kept and concatenated, then ``compute_metrics`` once (the
  same two metrics, computed from the full arrays).

It reports the growth of the process's peak resident memory during ``evaluate()`` over the memory before it
(Linux's ``VmHWM``, reset just before the call; the first call, so it includes the one-off cost of the first
evaluation), the extra memory per added eval sample and the ratio of the
largest size's growth to the smallest size's. Streamed: flat (about 0 MiB per sample, ratio near 1). Stock: linear
in the eval set size (the logits alone are ``size × seq_len × vocab × 4`` bytes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATHS = ("streamed", "stock")


def _peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def measure(path: str, size: int, vocab: int, seq_len: int, batch: int) -> dict:
    """In this process: evaluate once and return the peak memory growth of ``evaluate()`` in MiB."""
    import tempfile

    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer_ext import Trainer, TrainingArguments
    from trainer_ext.metrics import TrainerMetrics, build_metrics

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (size, seq_len), generator=torch.Generator().manual_seed(1)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    streamed = path == "streamed"
    metrics = TrainerMetrics(build_metrics("causal-lm", ["perplexity", "accuracy"]))

    def classic(pred) -> dict:  # every logit at once, as a compute_metrics written for transformers gets them
        return metrics(pred, compute_result=True)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_eval_batch_size=batch,
            batch_eval_metrics=streamed,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, eval_dataset=data, compute_metrics=metrics if streamed else classic)
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
        before = _resident_kib()
        result = trainer.evaluate()
        peak = _peak_kib()
    return {
        "path": path,
        "size": size,
        "growth_mib": (peak - before) / 1024,
        "logits_mib": size * seq_len * vocab * 4 / 2**20,
        "perplexity": float(np.float64(result["eval_perplexity"])),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256,1024", help="Eval set sizes, comma-separated.")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", help="Write the measurements to this file.")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "SIZE"), help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        path, size = opts.child
        print(json.dumps(measure(path, int(size), opts.vocab, opts.seq_len, opts.batch)))
        return
    sizes = [int(size) for size in opts.sizes.split(",")]
    rows = []
    for size in sizes:
        for path in PATHS:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", path, str(size)]
            cmd += ["--vocab", str(opts.vocab), "--seq_len", str(opts.seq_len), "--batch", str(opts.batch)]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{path} at {size} samples failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"vocab {opts.vocab}, sequence {opts.seq_len}, batch {opts.batch}: peak memory growth of evaluate()")
    print(f"{'eval samples':>12} {'logits MiB':>11} {'streamed MiB':>13} {'stock MiB':>10} {'perplexity equal':>17}")
    by = {(row["path"], row["size"]): row for row in rows}
    for size in sizes:
        s, k = by["streamed", size], by["stock", size]
        same = abs(s["perplexity"] - k["perplexity"]) <= 1e-4 * k["perplexity"]
        print(f"{size:>12} {s['logits_mib']:>11.0f} {s['growth_mib']:>13.1f} {k['growth_mib']:>10.1f} {same!s:>17}")
    first, last = sizes[0], sizes[-1]
    per_sample = by["stock", first]["logits_mib"] / first
    for path in PATHS:
        low, high = by[path, first]["growth_mib"], by[path, last]["growth_mib"]
        slope = (high - low) / (last - first)
        print(
            f"{path}: {slope:.3f} MiB more per eval sample (the logits of one sample: {per_sample:.3f} MiB); "
            f"growth at {last} / at {first} samples = {high / max(low, 1.0):.2f} (sizes ratio {last / first:g})"
        )
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
