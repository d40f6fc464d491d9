"""A seq2seq script written for ``transformers.Seq2SeqTrainer`` (a tiny BART from a config, generation in eval).

It knows nothing of trainer_ext; its last lines write ``run_info.json``, the tests' probe of the classes it got.
"""

import json
import os
import sys

import numpy as np
import torch
from datasets import Dataset
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)


def main():
    (training_args,) = HfArgumentParser(Seq2SeqTrainingArguments).parse_args_into_dataclasses()
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=32,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    model = BartForConditionalGeneration(config)
    # copy the next token: x, x+1 -> x+1, x+2 (every row the same length, so the default collator stacks them)
    rows = [{"input_ids": [5 + i % 20, 6 + i % 20, 2], "labels": [6 + i % 20, 7 + i % 20, 2]} for i in range(24)]
    dataset = Dataset.from_list(rows)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        return {"rows": int(preds.shape[0]), "token_ids": bool(np.issubdtype(preds.dtype, np.integer))}

    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(10)),
        compute_metrics=compute_metrics,
    )
    trainer.train()
    metrics = trainer.evaluate(max_length=4)
    trainer.save_metrics("eval", metrics)

    # --- the tests' probe of what this script was given ---
    if trainer.is_world_process_zero():
        info = {
            "trainer_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(trainer).__mro__],
            "args_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(training_args).__mro__],
            "accelerate_imported": "accelerate" in sys.modules,
            "world_size": training_args.world_size,
        }
        with open(os.path.join(training_args.output_dir, "run_info.json"), "w") as f:
            json.dump(info, f)


if __name__ == "__main__":
    main()
