"""Exact eval loss of a tiny GPT-2 on full-length rows with masked tails: ``python -m … OUT_DIR`` on N ranks.

GPT-2's head names no loss type, so transformers counts its labels unshifted although its loss (the causal-LM
default) predicts token i+1 from position i. Every row is 32 tokens long; after a random cut its labels are -100
and its attention mask 0. The same weights are evaluated at several per-device batch sizes; ``results.json``
holds ``eval_loss`` and ``eval_batch_mean_loss`` per batch size.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator

from tests.helpers.jobs import make_args
from trainer_ext import Trainer
from trainer_ext.distributed.state import destroy_process_group

SIZE = 13  # prime: an uneven last round on 2 processes at every batch size
LENGTH = 32
# on 2 ranks: 1 leaves rank 1 only repeats, 4 and 8 mix rank 1's last batch, 5 mixes rank 0's and empties rank 1's
BATCH_SIZES = (1, 4, 5, 8)


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 (n_embd 32, vocab 64) with random weights fixed by ``seed``."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=64, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2
    )
    return GPT2LMHeadModel(config)


def masked_tail_dataset(seed: int = 11) -> Dataset:
    """SIZE random rows of LENGTH tokens; after a cut in [4, LENGTH], labels -100 and attention mask 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (SIZE, LENGTH), generator=g)
    cuts = torch.randint(4, LENGTH + 1, (SIZE,), generator=g)
    keep = torch.arange(LENGTH) < cuts[:, None]
    labels = torch.where(keep, ids, torch.full_like(ids, -100))
    return Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": keep.long().tolist(), "labels": labels.tolist()}
    )


def reference_loss() -> float:
    """The token mean of the next-token loss over the whole set, computed one row at a time (float64 sums)."""
    model = tiny_gpt2().eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in masked_tail_dataset():
            ids = torch.tensor([row["input_ids"]])
            logits = model(input_ids=ids, attention_mask=torch.tensor([row["attention_mask"]])).logits[0, :-1]
            target = torch.tensor(row["labels"][1:])
            total += torch.nn.functional.cross_entropy(logits.double(), target, reduction="sum").item()
            tokens += int((target != -100).sum())
    return total / tokens


def main(out: str) -> None:
    out_dir = Path(out)
    results = {}
    for batch in BATCH_SIZES:
        trainer = Trainer(
            model=tiny_gpt2(),
            args=make_args(out_dir / str(batch), per_device_eval_batch_size=batch, exact_eval_loss=True),
            eval_dataset=masked_tail_dataset(),
            data_collator=default_data_collator,
        )
        metrics = trainer.evaluate()
        results[str(batch)] = {key: metrics[f"eval_{key}"] for key in ("loss", "batch_mean_loss")}
    if int(os.environ.get("RANK", "0")) == 0:
        (out_dir / "results.json").write_text(json.dumps(results))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
