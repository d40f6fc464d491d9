"""A link at ``checkpoint-2`` under 2 gloo ranks (test_links.py): every rank must refuse the save, none wait.

``python -m tests.checkpointing.link_job OUT VICTIM`` (under torchrun): rank 0 links ``OUT/run/checkpoint-2`` to the
folder VICTIM before training; each rank trains 2 steps with a save at step 2 and writes ``rank<R>.json`` with the
error it got (or none).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.errors import ConfigError


def main(out: str, victim: str) -> None:
    rank = int(os.environ["RANK"])
    run = Path(out) / "run"
    if rank == 0:
        run.mkdir(parents=True)
        (run / "checkpoint-2").symlink_to(victim, target_is_directory=True)
    args = make_args(run, save_strategy="steps", save_steps=2, max_steps=2, per_device_train_batch_size=1)
    error = None
    try:
        Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(8, seed=3)).train()
    except ConfigError as refused:
        error = str(refused)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"error": error}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
