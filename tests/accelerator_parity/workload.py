"""What the loop scripts share: tiny data and models, and the recorder of what a rank observes.

A script builds its model and data the way a user would (seeded, in code, no hub); the ``Recorder`` turns what it
sees into JSON (``rank{N}.json``) and tensors into safetensors files (rank 0), for ``compare``.
"""

from __future__ import annotations

import json
import math
import re
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass
class Context:
    """What a scenario gets: the accelerate names of one implementation, its phase, folders and recorder."""

    api: Any
    phase: str
    nproc: int
    workdir: Path  # shared by every phase and rank of one run (checkpoints, project folders)
    rec: Recorder


class RegressionData(Dataset):
    """``n`` rows ``{"idx", "x", "y"}`` of a noisy linear map; ``idx`` tells which sample a rank saw."""

    def __init__(self, n: int, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i), "x": self.x[i], "y": self.y[i]}


class RegressionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def loader(n: int, batch_size: int, shuffle: bool = False, seed: int = 1234, drop_last: bool = False) -> DataLoader:
    return DataLoader(RegressionData(n, seed), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def tiny_llama() -> nn.Module:
    """A 2-layer Llama (hidden 32) built from its config: a ``PreTrainedModel`` without the hub."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def error(exc: BaseException) -> dict[str, str]:
    """An exception as a user sees it (type and message); ``where`` is for the reader, never compared."""
    where = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-4:])
    return {"type": type(exc).__name__, "message": str(exc), "where": where[-2000:]}


def jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return jsonable(value.tolist())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class Recorder:
    """What one rank observes: ``data`` (JSON), and tensors saved by rank 0 as ``NAME.safetensors`` in ``outdir``."""

    def __init__(self, rank: int, outdir: Path, workdir: Path) -> None:
        self.rank, self.outdir, self.workdir = rank, outdir, workdir
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = jsonable(value)
        self.write()

    def add(self, key: str, value: Any) -> None:
        self.data.setdefault(key, []).append(jsonable(value))
        self.write()

    def stage(self, name: str, action: Callable[[], Any]) -> Any:
        """Run one independent part of a script; store its value, or the exception it raised, under ``name``."""
        try:
            value = action()
        except Exception as exc:
            self.put(name, {"error": error(exc)})
            return None
        self.put(name, value)
        return value

    def tensors(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Rank 0 saves ``state`` (compared as weights) and notes the file's name."""
        if self.rank == 0:
            self.data.setdefault("weights", {})[name] = f"{self.outdir.name}/{name}.safetensors"
            save_file(
                {k: v.detach().float().contiguous().cpu() for k, v in state.items()},
                self.outdir / f"{name}.safetensors",
            )
            self.write()

    def write(self) -> None:
        """The record, with the working folder written ``<WORKDIR>`` and loopback ports blanked (both vary by run).

        Written after every observation: a rank that hangs or crashes later (stock's gloo teardown does, now and
        then) leaves what it observed until then, so the comparison shows where it stopped.
        """
        text = json.dumps(self.data, indent=1, sort_keys=True)
        for root in sorted({str(self.workdir.resolve()), str(self.workdir)}, key=len, reverse=True):
            text = text.replace(root, "<WORKDIR>")
        text = re.sub(r"(\[127\.0\.0\.1\]|localhost):\d+", r"\1:<port>", text)
        path = self.outdir / f"rank{self.rank}.json"
        partial = path.with_suffix(".json.tmp")
        partial.write_text(text + "\n")
        partial.replace(path)  # a reader never sees half a record


class Epoch:
    """One rank's view of one training epoch: the sample ids of each batch, losses, LR after each step."""

    def __init__(self, recorder: Recorder, epoch: int) -> None:
        self.entry: dict[str, Any] = {"epoch": epoch, "ids": [], "loss": [], "loss_reduced": [], "lr": [], "sync": []}
        recorder.data.setdefault("epochs", []).append(self.entry)

    def step(self, accelerator: Any, batch: dict, loss: torch.Tensor, scheduler: Any, reduce: bool = True) -> None:
        """After the optimizer step. ``reduce``: also the mean loss over ranks (a collective: not on uneven shards)."""
        self.entry["ids"].append(batch["idx"].tolist())
        self.entry["loss"].append(loss.item())
        if reduce:
            self.entry["loss_reduced"].append(accelerator.reduce(loss.detach(), reduction="mean").item())
        self.entry["lr"].append(scheduler.get_last_lr()[0])
        self.entry["sync"].append(bool(accelerator.sync_gradients))


def train_epoch(
    accelerator: Any,
    model: nn.Module,
    optimizer: Any,
    batches: Iterable,
    scheduler: Any,
    trace: Epoch,
    reduce: bool = True,
    after_step: Callable[[], bool] | None = None,
) -> bool:
    """The examples' inner loop: per batch the loss, ``backward``, the optimizer's and scheduler's steps, ``zero_grad``
    and ``trace.step``, then ``after_step`` (True stops the loop there). Returns whether it was stopped."""
    model.train()
    for batch in batches:
        loss = loss_of(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        trace.step(accelerator, batch, loss, scheduler, reduce=reduce)
        if after_step is not None and after_step():
            return True
    return False


def evaluate(
    accelerator: Any, model: nn.Module, eval_dl: Iterable, recorder: Recorder, dataset_len: int, key: str = "eval"
) -> None:
    """The examples' evaluation: predictions gathered with ``gather_for_metrics``, one metric over all of them.

    ``dataset_len``: the evaluation set's size, which the gathered samples must cover exactly once."""
    model.eval()
    predictions, targets, ids, batches = [], [], [], 0
    for batch in eval_dl:
        with torch.no_grad():
            prediction = model(batch["x"])
        prediction, target, idx = accelerator.gather_for_metrics((prediction, batch["y"], batch["idx"]))
        predictions.append(prediction)
        targets.append(target)
        ids += idx.tolist()
        batches += 1
    mse = F.mse_loss(torch.cat(predictions), torch.cat(targets)).item() if predictions else None
    entry = {"batches": batches, "count": len(ids), "ids": ids, "metric": mse, "dataset_len": dataset_len}
    recorder.add(key, entry)
    model.train()


def final_weights(accelerator: Any, model: nn.Module, recorder: Recorder, name: str = "final") -> None:
    accelerator.wait_for_everyone()
    recorder.tensors(name, accelerator.unwrap_model(model).state_dict())
