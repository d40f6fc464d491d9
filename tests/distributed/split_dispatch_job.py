"""split_batches / dispatch_batches / iterable datasets: jobs run on 2 ranks under torchrun and on 1 rank in-process.

``python -m tests.distributed.split_dispatch_job OUT_DIR`` (under torchrun) runs every job; rank 0 writes ``results.json`` and the
trained weights. Loader jobs record each step's global batch (every rank's part, in rank order) so the tests can
compare it with one process reading the global batch.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.distributed import DistState, Engine, skip_first_batches
from trainer_ext.distributed.collectives import gather_object
from trainer_ext.errors import ConfigError


class Indices(Dataset):
    """Sample i is ``{"idx": i, "text": "s<i>"}``: a tensor column and a list-of-strings column once collated."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"idx": i, "text": f"s{i}"}


class Stream(IterableDataset):
    """The same samples as :class:`Indices`, as a stream without a length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return (Indices(self.n)[i] for i in range(self.n))


class Ragged(IterableDataset):
    """Batches of different widths: they cannot be joined into one global batch."""

    def __iter__(self):
        yield from (torch.zeros(1, k) for k in (2, 3, 4, 5))


def engine(**options) -> Engine:
    return Engine(DistState(cpu=True), seed=7, **options)


def steps(loader) -> dict:
    """Each step's parts (one list of ids per rank), the texts matching the ids, and the loader's remainder."""
    out, texts_match = [], True
    for batch in loader:
        ids = batch["idx"].tolist()
        texts_match &= batch["text"] == [f"s{i}" for i in ids]
        out.append(gather_object([ids]))
    return {"steps": out, "texts_match": bool(all(gather_object([texts_match]))), "remainder": loader.remainder}


def loader_jobs() -> dict:
    """Loaders over 37 (map) or 37 (stream) samples: batch 8 split, or 4 per rank dispatched / sharded / streamed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_rank = 8 // world
    jobs = {
        "split_map": (dict(split_batches=True), DataLoader(Indices(37), batch_size=8, shuffle=True)),
        "dispatch_map": (dict(dispatch_batches=True), DataLoader(Indices(37), batch_size=per_rank, shuffle=True)),
        "sharded_map": (dict(dispatch_batches=False), DataLoader(Indices(37), batch_size=per_rank, shuffle=True)),
        "dispatch_stream": ({}, DataLoader(Stream(37), batch_size=per_rank)),  # the default for an iterable
        "split_dispatch_stream": (dict(split_batches=True), DataLoader(Stream(37), batch_size=8)),
        "read_stream": (dict(dispatch_batches=False), DataLoader(Stream(37), batch_size=per_rank)),
        "dispatch_empty": ({}, DataLoader(Stream(0), batch_size=per_rank)),
        "dispatch_short_stream": ({}, DataLoader(Stream(3), batch_size=per_rank)),
    }
    results = {}
    for name, (options, loader) in jobs.items():
        eng = engine(**options)
        prepared = eng.prepare_dataloader(loader)
        results[name] = {"type": type(prepared).__name__, "len": _len(prepared), **steps(prepared)}
    return results


def _len(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def resume_job() -> dict:
    """A dispatched loader stopped after 2 batches and resumed from its state equals the uninterrupted run."""
    eng = engine(dispatch_batches=True)
    make = lambda: eng.prepare_dataloader(DataLoader(Indices(37), batch_size=2, shuffle=True))  # noqa: E731
    loader = make()
    loader.set_epoch(1)
    full = [b["idx"].tolist() for b in loader]
    loader = make()
    loader.set_epoch(1)
    for i, _ in enumerate(loader):
        if i == 1:
            state = loader.state_dict()
            break
    resumed = make()
    resumed.load_state_dict(state)
    skipped = skip_first_batches(make(), 3)
    skipped.set_epoch(1)
    return {
        "state": state,
        "resumed_ok": [b["idx"].tolist() for b in resumed] == full[2:],
        "skipped_ok": [b["idx"].tolist() for b in skipped] == full[3:],
    }


def error_job() -> list[str]:
    """Rank 0 fails to join the batches: every rank raises (none waits forever for a batch); each rank's message."""
    loader = engine().prepare_dataloader(DataLoader(Ragged(), batch_size=None))
    try:
        list(loader)
        message = "no error"
    except ConfigError as error:
        message = str(error)
    return gather_object([message])


class TokenStream(IterableDataset):
    """``lm_dataset(n)`` as a stream of tensors (no length): the Trainer must dispatch it on several ranks."""

    def __init__(self, n: int) -> None:
        self.rows = lm_dataset(n).with_format("torch")

    def __iter__(self):
        for row in self.rows:
            yield {"input_ids": row["input_ids"], "labels": row["labels"]}


def train_job(out: Path, per_device_batch: int) -> dict[str, torch.Tensor]:
    """8 optimizer steps (2 passes over 32 streamed samples); the same global batch whatever the world size."""
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(out, per_device_train_batch_size=per_device_batch, max_steps=8, lr_scheduler_type="linear"),
        train_dataset=TokenStream(32),
    )
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.config = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.lin(x).squeeze(-1)
        loss = ((out - labels) ** 2).mean() if labels is not None else None
        return {"loss": loss, "logits": out}


class RegressionStream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(self.n):
            x = torch.randn(4, generator=g)
            yield {"x": x, "labels": x.sum() * 0.5 + i * 0.01}


def eval_job(out: Path) -> dict:
    """evaluate() and predict() over a stream of 66 samples, batch 8 per device."""
    trainer = Trainer(
        model=Regression(),
        args=make_args(out, per_device_eval_batch_size=8),
        eval_dataset=RegressionStream(66),
    )
    metrics = trainer.evaluate()
    predictions = np.asarray(trainer.predict(RegressionStream(66)).predictions)
    return {"eval_loss": metrics["eval_loss"], "predictions": predictions.tolist()}


def main(out: str) -> None:
    out_dir = Path(out)
    rank = int(os.environ.get("RANK", "0"))
    results = {
        "loaders": loader_jobs(),
        "resume": resume_job(),
        "error": error_job(),
        "eval": eval_job(out_dir / "eval"),
    }
    weights = train_job(out_dir / "train", per_device_batch=4)
    if rank == 0:
        save_file(weights, str(out_dir / "train.safetensors"))
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    gc.collect()  # drop the DDP reducers before the group goes
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
