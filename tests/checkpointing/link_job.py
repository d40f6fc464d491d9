"""Links where a job writes, under 2 gloo ranks (test_links.py): every rank must refuse, none wait.

``python -m tests.checkpointing.link_job OUT VICTIM checkpoint`` (under torchrun): rank 0 links
``OUT/run/checkpoint-2`` to the folder VICTIM before training; each rank trains 2 steps with a save at step 2.
``… OUT VICTIM export``: FSDP2, no checkpoints; rank 0 links ``OUT/run/config.json`` to the file VICTIM after step 1,
where the final (gathered) model goes. Each rank writes ``rank<R>.json`` with the error it got (or none).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from transformers import TrainerCallback

from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.errors import ConfigError


class LinkAfterStep(TrainerCallback):
    """Rank 0 plants ``path`` -> ``target`` after step 1 (a link made while the job runs)."""

    def __init__(self, path: Path, target: str) -> None:
        self.path, self.target = path, target

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and int(os.environ["RANK"]) == 0:
            self.path.symlink_to(self.target)


def main(out: str, victim: str, where: str) -> None:
    rank = int(os.environ["RANK"])
    run = Path(out) / "run"
    settings = dict(max_steps=2, per_device_train_batch_size=1)
    callbacks = []
    if where == "checkpoint":
        settings.update(save_strategy="steps", save_steps=2)
        if rank == 0:
            run.mkdir(parents=True)
            (run / "checkpoint-2").symlink_to(victim, target_is_directory=True)
    else:
        settings.update(fsdp=True, save_final_model=True)
        callbacks.append(LinkAfterStep(run / "config.json", victim))
    error = None
    try:
        trainer = Trainer(model=tiny_llama(0), args=make_args(run, **settings), train_dataset=lm_dataset(8, seed=3))
        for callback in callbacks:
            trainer.add_callback(callback)
        trainer.train()
    except ConfigError as refused:
        error = str(refused)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"error": error}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
