"""Rank job: LoRA on a tiny Llama trained by our Trainer with tensor parallelism (``tp_size`` = the world size), or
the same job on one process without it; writes the logged losses and grad norms to OUT/result.json and the adapter
the final save writes to OUT/final.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.with_peft.peft_tp_job OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.helpers.tiny import lm_dataset, tiny_llama

# q/up column-split, o/down row-split: the adapter factor on each split side is sharded with its base layer
TARGETS = ["q_proj", "o_proj", "up_proj", "down_proj"]
STEPS = 10


def tp_lora_job(out: Path) -> dict:
    """Train 10 steps (accumulation 2, clipping at 0.5) and save; returns the logged losses and grad norms."""
    from peft import LoraConfig, get_peft_model

    from trainer_ext import ParallelismConfig, Trainer, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(tiny_llama(0), config)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        parallelism_config=ParallelismConfig(tp_size=world) if world > 1 else None,
    )
    trainer = Trainer(model=model, args=args, train_dataset=lm_dataset(96))
    trainer.train()
    trainer.save_model(str(out / "final"))
    history = trainer.state.log_history
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "dtensors": sum(type(p).__name__ == "DTensor" for p in trainer.model_wrapped.parameters()),
    }


if __name__ == "__main__":
    target = Path(sys.argv[1])
    seen = tp_lora_job(target)
    if int(os.environ.get("RANK", "0")) == 0:
        (target / "result.json").write_text(json.dumps(seen))
