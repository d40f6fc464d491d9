"""accelerate's resume (``load_state`` then ``skip_first_batches``) and ``load_state`` alone on every loader kind.

``python -m tests.helpers.skip_resume_job OUT_DIR`` (1 or 2 ranks under torchrun): for a map-style, an iterable
and a dispatched loader, the batches after step 3 of an uninterrupted epoch, of each resume style, and the next
epoch's; each rank writes ``rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

from trainer_ext import Accelerator, DataLoaderConfiguration

SAMPLES, BATCH, STOP = 24, 2, 3


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(SAMPLES))


def _make(kind: str) -> tuple[Accelerator, DataLoader]:
    config = DataLoaderConfiguration(dispatch_batches=True if kind == "dispatch" else None)
    acc = Accelerator(cpu=True, dataloader_config=config)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = list(range(SAMPLES)) if kind == "map" else Stream()
    _, _, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=BATCH))
    return acc, loader


def run(kind: str, folder: Path) -> dict:
    acc, loader = _make(kind)
    full = []
    for i, batch in enumerate(loader):
        full.append(batch.tolist())
        if i == STOP - 1:
            acc.save_state(str(folder))
    next_epoch = [b.tolist() for b in loader]
    acc, loader = _make(kind)
    acc.load_state(str(folder))
    skipped = [b.tolist() for b in acc.skip_first_batches(loader, STOP)]
    after_skip = [b.tolist() for b in loader]
    acc, loader = _make(kind)
    acc.load_state(str(folder))
    alone = [b.tolist() for b in loader]
    after_alone = [b.tolist() for b in loader]
    return {
        "rest": full[STOP:],
        "next_epoch": next_epoch,
        "load_and_skip": skipped,
        "after_skip": after_skip,
        "load_alone": alone,
        "after_alone": after_alone,
    }


def main(out: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kinds = ["map", "iterable"] + (["dispatch"] if world > 1 else [])
    results = {kind: run(kind, Path(out) / f"ckpt_{kind}") for kind in kinds}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
