"""Shared bits of the example loops: command-line flags and a word-level tokenizer built from the data."""

from __future__ import annotations

import argparse

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers


def parse_args(description: str, **defaults) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--mixed_precision", choices=["no", "bf16", "fp16", "fp8"], default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    parser.add_argument("--epochs", type=int, default=defaults.get("epochs", 2))
    parser.add_argument("--batch_size", type=int, default=defaults.get("batch_size", 16), help="per process")
    parser.add_argument("--lr", type=float, default=defaults.get("lr", 2e-3))
    parser.add_argument("--max_train_samples", type=int, default=None)
    parser.add_argument("--with_tracking", action="store_true", help="log to TensorBoard under --output_dir")
    parser.add_argument("--output_dir", default=defaults.get("output_dir", "outputs/example"))
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def word_tokenizer(texts: list[str], specials: list[str]) -> Tokenizer:
    """A lower-cased word-level tokenizer; deterministic, so every process builds the same vocabulary."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials, show_progress=False))
    return tokenizer


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    longest = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (longest - len(r)) for r in rows])
