"""accelerate's resume pattern, written as its examples write it, on trainer_ext.Accelerator.

``run(...)`` trains a tiny regression model for a few epochs over a shuffled loader (accelerate's default: no
seedable sampler), recording which samples each step saw and the LR, and can stop after ``stop_at`` steps with a
``save_state``. Resuming, it calls ``load_state`` and then, in ``"accelerate"`` style, ``skip_first_batches`` for
the resumed epoch (``examples/by_feature/checkpointing.py``), or in ``"ours"`` style nothing more.
``python -m tests.helpers.resume_loops OUT`` (under torchrun) writes rank-0 results for the multi-rank test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import get_linear_schedule_with_warmup, set_seed

from tests.helpers.device import use_cpu
from trainer_ext import Accelerator

SAMPLES = 100
BATCH = 2
EPOCHS = 2


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=g)
    return torch.utils.data.TensorDataset(torch.arange(SAMPLES), x, x.sum(dim=1, keepdim=True))


def run(
    out: Path, stop_at: int | None = None, resume: str | None = None, accelerator_kwargs: dict | None = None
) -> dict[str, Any]:
    """Train; record per epoch the sample ids of each step (this rank), the LRs, and the final weights."""
    set_seed(0)
    accelerator = Accelerator(cpu=use_cpu(), **(accelerator_kwargs or {}))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH, shuffle=True)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, len(loader) * EPOCHS)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    starting_epoch, resume_step = 0, None
    if resume is not None:
        accelerator.load_state(str(out / "state"))
        done = json.loads((out / "stopped.json").read_text())["step"]  # the example parses it from the folder name
        starting_epoch, resume_step = divmod(done, len(loader))
    seen: dict[int, list[list[int]]] = {}
    lrs: list[float] = []
    step = starting_epoch * len(loader) + (resume_step or 0)
    for epoch in range(starting_epoch, EPOCHS):
        active = loader
        if resume == "accelerate" and epoch == starting_epoch and resume_step is not None:
            active = accelerator.skip_first_batches(loader, resume_step)
        for ids, x, y in active:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            seen.setdefault(epoch, []).append(ids.tolist())
            lrs.append(scheduler.get_last_lr()[0])
            step += 1
            if step == stop_at:
                accelerator.save_state(str(out / "state"))
                if accelerator.is_main_process:
                    (out / "stopped.json").write_text(json.dumps({"step": step}))
                accelerator.wait_for_everyone()
                return {"seen": seen, "lrs": lrs}
    weights = {k: v.tolist() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"seen": seen, "lrs": lrs, "weights": weights, "batches_per_epoch": {e: len(b) for e, b in seen.items()}}


def main(out: Path) -> None:
    """Uninterrupted, stopped at step 20, resumed in both styles: every rank's records, gathered on rank 0."""
    results = {"full": run(out)}
    run(out, stop_at=20)
    results["accelerate"] = run(out, resume="accelerate")
    results["ours"] = run(out, resume="ours")
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, results)
    if torch.distributed.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(gathered))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
