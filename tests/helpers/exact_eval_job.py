"""Exact eval loss on N ranks: ``python -m tests.helpers.exact_eval_job OUT_DIR SIZE`` (torchrun).

One fixed tiny Llama evaluated on SIZE ragged sequences (a prime, so every world size leaves an uneven last round)
with per-device batches of 1, 3 and 8, from a map-style dataset and from an iterable one (read by every rank, or
dispatched from rank 0). Each evaluation records
the exact ``eval_loss``, transformers' ``eval_batch_mean_loss``, the streamed perplexity and token accuracy, and how
many samples reached ``compute_metrics`` on the classic (concatenating) path.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForSequenceClassification

from tests.helpers.jobs import make_args
from tests.helpers.paths import CONFIGS
from tests.helpers.tiny import pad_right, ragged_lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.distributed.state import destroy_process_group
from trainer_ext.metrics import TrainerMetrics, build_metrics

BATCH_SIZES = (1, 3, 8)
# map-style; iterable read by every rank (dispatch_batches=False); iterable read by rank 0 and dispatched
KINDS = ("map", "iterable", "dispatched")


def count_samples(pred) -> dict:
    """The classic path's view: how many samples (and label tokens) reached compute_metrics."""
    labels = np.asarray(pred.label_ids)
    return {"samples": int(labels.shape[0]), "tokens": int((labels[:, 1:] != -100).sum())}


def fixed_length(features: list[dict]) -> dict[str, torch.Tensor]:
    """Every batch padded to 16 tokens: dispatching joins the batches of all processes into one."""
    batch = pad_right(features)
    width = 16 - batch["input_ids"].shape[1]
    fill = {"input_ids": 0, "labels": -100, "attention_mask": 0}
    return {key: torch.nn.functional.pad(value, (0, width), value=fill[key]) for key, value in batch.items()}


def evaluate(out: Path, size: int, batch: int, kind: str, streamed: bool, **strategy) -> dict:
    data = ragged_lm_dataset(size, seed=7)
    collator, dispatch = pad_right, None
    if kind != "map":
        data = data.to_iterable_dataset()
        dispatch = kind == "dispatched"
        collator = fixed_length if dispatch else pad_right
    metrics = TrainerMetrics(build_metrics("causal-lm", ["perplexity", "accuracy"])) if streamed else count_samples
    trainer = Trainer(
        model=tiny_llama(2),
        args=make_args(
            out,
            per_device_eval_batch_size=batch,
            exact_eval_loss=True,
            batch_eval_metrics=streamed,
            accelerator_config={"dispatch_batches": dispatch},
            **strategy,
        ),
        eval_dataset=data,
        data_collator=collator,
        compute_metrics=metrics,
    )
    return trainer.evaluate()


def classify(out: Path, size: int, batch: int) -> dict:
    """A per-sample loss: a tiny Llama classifier on ``size`` ragged sequences labelled by their length's parity."""
    data = ragged_lm_dataset(size, seed=7)
    data = data.map(lambda row: {"label": len(row["input_ids"]) % 2})
    config = tiny_llama(2).config
    config.num_labels = 2
    torch.manual_seed(3)
    model = LlamaForSequenceClassification(config)

    def collate(features: list[dict]) -> dict[str, torch.Tensor]:
        batch = pad_right([{"input_ids": f["input_ids"]} for f in features])
        labels = torch.tensor([f["label"] for f in features])
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}

    trainer = Trainer(
        model=model,
        args=make_args(out, per_device_eval_batch_size=batch, exact_eval_loss=True),
        eval_dataset=data,
        data_collator=collate,
    )
    return trainer.evaluate()


def full_predictions(out: Path, size: int) -> dict:
    """``predict`` with every prediction kept three ways: at once, offloaded every 2 batches, not concatenated."""
    found = {}
    for name, flags in (
        ("default", {}),
        ("accumulated", {"eval_accumulation_steps": 2}),
        ("batches", {"eval_do_concat_batches": False}),
    ):
        trainer = Trainer(
            model=tiny_llama(2),
            args=make_args(out / name, per_device_eval_batch_size=3, exact_eval_loss=True, **flags),
            data_collator=pad_right,
        )
        found[name] = trainer.predict(ragged_lm_dataset(size, seed=7))
    default = found["default"]
    pieces = found["batches"].predictions
    starts = np.cumsum([0] + [len(piece) for piece in pieces])
    # not concatenated: one array per gathered batch, padded to that batch's own longest sequence
    same_batches = starts[-1] == len(default.predictions) and all(
        np.allclose(piece, default.predictions[start : start + len(piece), : piece.shape[1]])
        for piece, start in zip(pieces, starts, strict=False)
    )
    return {
        "rows": len(default.predictions),
        "accumulated_equal": bool(np.array_equal(default.predictions, found["accumulated"].predictions)),
        "accumulated_loss": found["accumulated"].metrics["test_loss"],
        "batches": len(pieces),
        "batches_equal": bool(same_batches),
        "loss": default.metrics["test_loss"],
    }


STRATEGIES = {
    "none": {},
    "fsdp": {"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}},
    "zero3": {"deepspeed": str(CONFIGS / "deepspeed" / "zero3.json")},
}


def main(out: str, size: str, strategy: str = "none") -> None:
    out_dir = Path(out)
    results = {}
    kinds = KINDS if strategy == "none" else ("map",)
    for kind in kinds:
        for batch in BATCH_SIZES:
            for streamed in (True, False):
                key = f"{kind}-{batch}-{'streamed' if streamed else 'classic'}"
                results[key] = evaluate(out_dir / key, int(size), batch, kind, streamed, **STRATEGIES[strategy])
    if strategy == "none":
        results["predict"] = full_predictions(out_dir / "predict", int(size))
        for batch in BATCH_SIZES:
            results[f"classify-{batch}"] = classify(out_dir / f"classify-{batch}", int(size), batch)
    if int(os.environ.get("RANK", "0")) == 0:
        (out_dir / "results.json").write_text(json.dumps(results))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        destroy_process_group()  # DeepSpeed's references to the group go too (a gloo group freed late can abort)


if __name__ == "__main__":
    main(*sys.argv[1:])
