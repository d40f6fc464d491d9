"""A loop started under stock accelerate and continued, from accelerate's ``save_state`` folder, under either
implementation: the job of ``test_migrate_from_accelerate.py``.

    python -m torch.distributed.run --standalone --nproc_per_node N -m tests.accelerator_parity.migrate_job \\
        --impl stock|ours --variant explicit|automatic --phase full|resumed --workdir W --out O [--checkpoint C]

Written as accelerate's ``examples/by_feature/checkpointing.py`` resumes: ``load_state``, then
``skip_first_batches(train_dl, n)`` in the resumed epoch (where it stopped is read from a registered object).

- ``explicit``: unshuffled, no dropout; ``full`` saves ``save_state(W/ck_safe)`` and
  ``save_state(W/ck_bin, safe_serialization=False)`` mid-epoch 1 and runs on to the end (the uninterrupted run).
- ``automatic``: shuffled, dropout, 2 accumulation steps, ``ProjectConfiguration(automatic_checkpoint_naming=True)``;
  ``full`` saves ``checkpoint_0`` after epoch 0 and ``checkpoint_1`` mid-epoch 1 (mid accumulation window);
  ``resumed`` calls ``load_state()`` with no folder and saves ``checkpoint_2`` at the end.

``ours`` runs with accelerate hidden from the import system. Every rank writes ``rank<N>.json`` into ``O`` (steps,
losses, LRs, RNG fingerprints, the step counter); rank 0 writes weights as safetensors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import pickle
import random
import sys
from pathlib import Path
from typing import Any

from tests.parity_harness.workload import set_up

EPOCHS, TRAIN_N, BATCH, SEED = 3, 48, 4, 42
STOP = {1: 5, 2: 3}  # mid-epoch 1: batches of this process read in that epoch when the job saves


class Progress:
    """Where the loop is, registered for checkpointing: the resumed run reads where to continue from it."""

    def __init__(self) -> None:
        self.epoch, self.batches = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batches = int(state["epoch"]), int(state["batches"])


def fingerprint() -> dict[str, str]:
    """The global RNGs' states, hashed (reading them draws nothing)."""
    import numpy as np
    import torch

    def digest(value: Any) -> str:
        return hashlib.sha256(pickle.dumps(value)).hexdigest()[:16]

    return {
        "python": digest(random.getstate()),
        "numpy": digest(np.random.get_state()[1].tobytes()),
        "torch": digest(torch.get_rng_state().numpy().tobytes()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("stock", "ours"), required=True)
    parser.add_argument("--variant", choices=("explicit", "automatic"), required=True)
    parser.add_argument("--phase", choices=("full", "resumed"), required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--iteration", type=int, default=None)
    args = parser.parse_args()
    set_up(args.impl)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s", stream=sys.stdout)
    run(args)


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from torch import nn
    from transformers import get_linear_schedule_with_warmup

    from tests.accelerator_parity.api import Api
    from tests.accelerator_parity.workload import loader

    api = Api(args.impl)
    automatic = args.variant == "automatic"
    project = args.workdir / "project"
    if automatic:
        config = {"project_dir": str(project), "automatic_checkpoint_naming": True}
        if args.iteration is not None:
            config["iteration"] = args.iteration
        accelerator = api.Accelerator(
            cpu=True, gradient_accumulation_steps=2, project_config=api.ProjectConfiguration(**config)
        )
    else:
        accelerator = api.Accelerator(cpu=True)
    rank, nproc = accelerator.process_index, accelerator.num_processes
    record: dict[str, Any] = {"steps": [], "impl": args.impl}

    def write() -> None:
        (args.out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))

    def weights(name: str) -> None:
        accelerator.wait_for_everyone()
        if rank == 0:
            state = accelerator.unwrap_model(model).state_dict()
            save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(args.out / f"{name}.st"))

    api.set_seed(SEED)
    train_dl = loader(TRAIN_N, BATCH, shuffle=automatic)
    dropout = 0.2 if automatic else 0.0
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=len(train_dl) * 3)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    starting_epoch, skip = 0, 0
    if args.phase == "resumed":
        accelerator.load_state(args.checkpoint)  # None: the newest under project_dir/checkpoints
        starting_epoch, skip = progress.epoch, progress.batches
        record["after_load"] = {
            "rng": fingerprint(),
            "step": accelerator.step,
            "progress": progress.state_dict(),
            "save_iteration": accelerator.save_iteration if automatic else None,
            "lr": scheduler.get_last_lr()[0],
        }
        weights("after_load")
    for epoch in range(starting_epoch, EPOCHS):
        model.train()
        active = accelerator.skip_first_batches(train_dl, skip) if epoch == starting_epoch and skip else train_dl
        done = skip if epoch == starting_epoch else 0
        for batch in active:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(batch["x"]), batch["y"])
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            done += 1
            progress.epoch, progress.batches = epoch, done
            step = {"epoch": epoch, "batch": done, "ids": batch["idx"].tolist(), "loss": loss.item()}
            step.update(lr=scheduler.get_last_lr()[0], sync=bool(accelerator.sync_gradients))
            record["steps"].append(step)
            if args.phase == "full" and epoch == 1 and done == STOP[nproc]:
                record["at_save"] = {"rng": fingerprint(), "step": accelerator.step, "lr": step["lr"]}
                weights("at_save")
                if automatic:
                    accelerator.save_state()
                else:
                    accelerator.save_state(str(args.workdir / "ck_safe"))
                    accelerator.save_state(str(args.workdir / "ck_bin"), safe_serialization=False)
                accelerator.wait_for_everyone()
        progress.epoch, progress.batches = epoch + 1, 0
        if automatic and (args.phase == "resumed" and epoch == EPOCHS - 1 or args.phase == "full" and epoch == 0):
            accelerator.save_state()
            accelerator.wait_for_everyone()
        write()
    weights("final")
    record["accelerate_imported"] = "accelerate" in sys.modules
    record["checkpoints"] = sorted(p.name for p in (project / "checkpoints").iterdir()) if automatic else None
    write()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
