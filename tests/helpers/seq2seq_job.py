"""A Seq2Seq job written against ``trainer_ext.Seq2SeqTrainer`` / ``Seq2SeqTrainingArguments``, parsed from flags.

``python -m tests.helpers.seq2seq_job OUT [flags]`` on any number of ranks: the global batch is 4 whatever the
number of processes. It predicts (generating) with the fresh model, trains 3 steps, evaluates and predicts again;
rank 0 writes ``OUT/result.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import HfArgumentParser

from tests.helpers.tiny import copy_rows, tiny_t5
from trainer_ext import Seq2SeqTrainer, Seq2SeqTrainingArguments


def main() -> None:
    out = Path(sys.argv[1])
    parser = HfArgumentParser(Seq2SeqTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(sys.argv[2:])
    trainer = Seq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=copy_rows(24, 0), eval_dataset=copy_rows(8, 1))
    before = trainer.predict(copy_rows(8, 2))
    trainer.train()
    metrics = trainer.evaluate()
    after = trainer.predict(copy_rows(8, 2))
    if trainer.is_world_process_zero():
        result = {
            "world_size": args.world_size,
            "args_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(args).__mro__],
            "engine": type(trainer.accelerator).__module__,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "eval_loss": metrics["eval_loss"],
            "before": before.predictions.tolist(),
            "after_shape": list(after.predictions.shape),
            "test_loss": after.metrics["test_loss"],
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
