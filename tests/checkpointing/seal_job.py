"""2-process Trainer runs for test_seal.py: one stopped at step 4, the uninterrupted one, and a resume.

``python -m tests.checkpointing.seal_job OUT PHASE`` under torchrun: ``first`` writes ``OUT/run`` (checkpoints 2
and 4) and ``OUT/full.safetensors``; ``resume`` resumes ``OUT/run/checkpoint-4`` into ``OUT/resumed.safetensors``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import save_file

from tests.helpers.jobs import StopAt, make_args, weights
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer

DATA = lm_dataset(16, seed=3)
# 8 steps of 2 samples (1 per process), saved every 2
COMMON = dict(save_strategy="steps", save_steps=2, num_train_epochs=1, per_device_train_batch_size=1)


def _trainer(out: Path) -> Trainer:
    return Trainer(model=tiny_llama(0), args=make_args(out, **COMMON), train_dataset=DATA)


def main(out: str, phase: str) -> None:
    root = Path(out)
    if phase == "first":
        stopped = _trainer(root / "run")
        stopped.add_callback(StopAt(4))
        stopped.train()
        trainer, name = _trainer(root / "full"), "full"
        trainer.train()
    else:
        trainer, name = _trainer(root / "run"), "resumed"
        trainer.train(resume_from_checkpoint=str(root / "run" / "checkpoint-4"))
    if trainer.args.process_index == 0:
        save_file(weights(trainer), str(root / f"{name}.safetensors"))


if __name__ == "__main__":
    main(*sys.argv[1:])
