"""Shared bits of the example loops: command-line flags, a word-level tokenizer built from the data, padding."""

from __future__ import annotations

import argparse
import os

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from trainer_ext import Accelerator


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


def word_tokenizer(texts: list[str], specials: list[str], first: str) -> Tokenizer:
    """A lower-cased word-level tokenizer that starts every text with the special token ``first``."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials, show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{first} $A", special_tokens=[(first, tokenizer.token_to_id(first))]
    )
    return tokenizer


def shared_tokenizer(
    accelerator: Accelerator, directory: str, texts: list[str], first: str, **special_tokens: str
) -> PreTrainedTokenizerFast:
    """Trained and saved to ``directory`` by the main process only; call it inside ``main_process_first``.

    Every process loads the saved files, so all of them hash the tokenizer alike and reuse the main process's
    ``datasets.map`` cache. ``directory`` is where the model is saved too: the folder loads with from_pretrained.
    """
    if accelerator.is_main_process:
        specials = list(dict.fromkeys(["[PAD]", "[UNK]", *special_tokens.values()]))
        backend = word_tokenizer(texts, specials, first)
        os.makedirs(directory, exist_ok=True)
        PreTrainedTokenizerFast(
            tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", model_max_length=64, **special_tokens
        ).save_pretrained(directory)
    return PreTrainedTokenizerFast.from_pretrained(directory)


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    longest = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (longest - len(r)) for r in rows])
