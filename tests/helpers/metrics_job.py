"""Streamed metrics under the Trainer on N ranks: ``python -m tests.helpers.metrics_job OUT_DIR`` (torchrun).

11 ragged sequences, 2 per rank per step: the last round is padded with repeated samples, which the per-batch
gather must drop, and every batch is padded to a different length, which the -100 labels must hide.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tests.helpers.jobs import make_args
from tests.helpers.tiny import pad_right, ragged_lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.metrics import TrainerMetrics, build_metrics


def lm_metrics_job(out: Path, batch_eval_metrics: bool = True) -> dict:
    """eval_perplexity and eval_accuracy (next token) of a fixed tiny Llama on 11 ragged sequences."""
    trainer = Trainer(
        model=tiny_llama(1),
        args=make_args(out, per_device_eval_batch_size=2, batch_eval_metrics=batch_eval_metrics),
        eval_dataset=ragged_lm_dataset(11, seed=3),
        data_collator=pad_right,
        compute_metrics=TrainerMetrics(build_metrics("causal-lm", ["perplexity", "accuracy"])),
    )
    return trainer.evaluate()


def main(out: str) -> None:
    out_dir = Path(out)
    result = lm_metrics_job(out_dir / "lm")
    if int(os.environ.get("RANK", "0")) == 0:
        (out_dir / "results.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
