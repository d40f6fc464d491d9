"""A head whose forward accepts ``num_items_in_batch`` but returns a plain mean loss, trained on N ranks.

``python -m tests.helpers.mean_loss_job OUT_DIR`` (N ranks): a tiny BERT sequence classifier, built from a config
without dropout, trains 4 optimizer steps of 8 samples (per-device batch 8 / (ranks x accumulation)) with
transformers' default gradient clipping, then evaluates. Rank 0 writes ``results.json`` (logged losses, gradient
norms, ``eval_loss``) and the final weights per accumulation setting; every rank writes the lines our Trainer
logged while it was built.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import BertConfig, BertForSequenceClassification

from tests.helpers.jobs import make_args, weights
from trainer_ext import Trainer
from trainer_ext.distributed.state import destroy_process_group

GLOBAL_BATCH = 8
ACCUMULATIONS = {1: (1,), 2: (1, 2)}  # per world size


def tiny_bert_classifier() -> BertForSequenceClassification:
    """2 layers, hidden 32, 3 labels, no dropout (N ranks must compute what 1 does); weights fixed by seed 0."""
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def classification_data(n: int = 32) -> Dataset:
    """``n`` random rows of 12 tokens labelled by their first token modulo 3."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (n, 12), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids[:, 0] % 3).tolist()})


class Lines(logging.Handler):
    """Keeps the messages of the records it sees."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run(out: Path, accumulation: int) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = make_args(
        out,
        per_device_train_batch_size=GLOBAL_BATCH // (world * accumulation),
        per_device_eval_batch_size=GLOBAL_BATCH // world,
        gradient_accumulation_steps=accumulation,
        max_steps=4,
        max_grad_norm=1.0,
    )
    data = classification_data()
    lines = Lines()
    logger = logging.getLogger("trainer_ext")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        trainer = Trainer(model=tiny_bert_classifier(), args=args, train_dataset=data, eval_dataset=data)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "loss": [entry["loss"] for entry in logged],
        "grad_norm": [entry["grad_norm"] for entry in logged],
        "eval_loss": trainer.evaluate()["eval_loss"],
        "accepts_loss_kwargs": trainer.model_accepts_loss_kwargs,
    }
    return result, weights(trainer), lines.lines


def main(out: str) -> None:
    out_dir = Path(out)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    results, logs = {}, {}
    for accumulation in ACCUMULATIONS[world]:
        key = f"{world}x{accumulation}"
        results[key], state, logs[key] = run(out_dir / key, accumulation)
        if rank == 0:
            save_file(state, out_dir / f"{key}.safetensors")
    (out_dir / f"logs-{rank}.json").write_text(json.dumps(logs))
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
