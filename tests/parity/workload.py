"""What the parity scenarios train on: small models, generated data, metrics, the shared flags, user callbacks.

Small enough for a 2-core CPU and deterministic given the seed; nothing comes from a hub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    TrainerCallback,
)
from transformers.utils import ModelOutput

from .observe import metrics
from .registry import Impl


class RegressionModel(nn.Module):
    """A user's own model: a plain nn.Module, no config, returning a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.config = None
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, labels=None, idx=None):
        prediction = self.body(x).squeeze(-1)
        loss = nn.functional.mse_loss(prediction, labels) if labels is not None else None
        return {"loss": loss, "logits": prediction}


@dataclass
class RegressionOutput(ModelOutput):
    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None


class RegressionModelWithOutput(RegressionModel):
    """The same model returning a ``ModelOutput`` (the transformers convention)."""

    def forward(self, x, labels=None, idx=None):
        out = super().forward(x, labels=labels)
        return RegressionOutput(loss=out["loss"], logits=out["logits"])


class RegressionModelWithKwargs(RegressionModel):
    """A model whose forward takes ``**kwargs`` (so the Trainer passes ``num_items_in_batch``) but ignores them."""

    def forward(self, x, labels=None, idx=None, **kwargs):
        return super().forward(x, labels=labels)


def regression_arrays(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(n, generator=generator)
    return x, y


def regression_dataset(n: int, seed: int = 0, first_id: int = 0) -> datasets.Dataset:
    """A map-style ``datasets.Dataset`` with columns x, labels and idx (the sample's number)."""
    x, y = regression_arrays(n, seed)
    return datasets.Dataset.from_dict(
        {"x": x.tolist(), "labels": y.tolist(), "idx": list(range(first_id, first_id + n))}
    )


class RegressionTorchDataset(Dataset):
    """A map-style torch Dataset of dicts."""

    def __init__(self, n: int, seed: int = 0, first_id: int = 0) -> None:
        self.x, self.y = regression_arrays(n, seed)
        self.first_id = first_id

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "labels": self.y[i], "idx": self.first_id + i}


class RegressionStream(IterableDataset):
    """A torch IterableDataset (no ``__len__``): the Trainer needs ``max_steps`` to train on it."""

    def __init__(self, n: int, seed: int = 0, first_id: int = 0) -> None:
        self.x, self.y = regression_arrays(n, seed)
        self.first_id = first_id

    def __iter__(self):
        for i in range(len(self.y)):
            yield {"x": self.x[i], "labels": self.y[i], "idx": self.first_id + i}


# The dimensions both tiny transformers share: two layers of width 32 over a vocabulary of 64 tokens.
TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def tiny_llama() -> LlamaForCausalLM:
    """A 2-layer LlamaForCausalLM from a config (random weights: seed first)."""
    return LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2, max_position_embeddings=64))


def token_dataset(
    n: int, length: int = 16, first_id: int = 0, seed: int = 0, ragged: bool = False
) -> datasets.Dataset:
    """Causal-LM rows whose first token is the sample's number; ``ragged`` pads rows to different lengths."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
    for i in range(n):
        ids = rng.integers(1, 64, size=length).tolist()
        ids[0] = first_id + i
        used = int(rng.integers(4, length + 1)) if ragged else length
        mask = [1] * used + [0] * (length - used)
        rows["input_ids"].append(ids)
        rows["attention_mask"].append(mask)
        rows["labels"].append([t if m else -100 for t, m in zip(ids, mask, strict=True)])
    return datasets.Dataset.from_dict(rows)


def tiny_bert() -> BertForSequenceClassification:
    """A 2-layer BertForSequenceClassification with 3 labels, from a config (random weights: seed first)."""
    return BertForSequenceClassification(BertConfig(**TINY, max_position_embeddings=32, num_labels=3))


def classification_dataset(n: int, first_id: int = 0, seed: int = 0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 64, size=(n, 12))
    ids[:, 0] = np.arange(first_id, first_id + n)
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist(), "labels": (ids[:, 1] % 3).tolist()}
    )


def accuracy(eval_pred) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def regression_metrics(eval_pred) -> dict[str, float]:
    predictions, labels = eval_pred
    return {"mse": float(((predictions - labels) ** 2).mean()), "mean_prediction": float(predictions.mean())}


def trainer_state(path: Path) -> dict[str, Any]:
    """A saved trainer_state.json, its clock-dependent values blanked."""
    state = json.loads(path.read_text())
    state["log_history"] = [metrics(entry) for entry in state.get("log_history", [])]
    return metrics(state)


def pickled_class(path: Path) -> str:
    """The class of the object pickled in a file (training_args.bin): what unpickling it will need."""
    value = torch.load(path, weights_only=False)
    return f"{type(value).__module__}.{type(value).__qualname__}"


def training_args(impl: Impl, workdir: Path, **overrides: Any) -> Any:
    """The flags every scenario shares (CPU, no trackers, no progress bar, a log entry per step)."""
    values: dict[str, Any] = {
        "output_dir": str(workdir / "out"),
        "use_cpu": True,
        "report_to": [],
        "disable_tqdm": True,
        "logging_steps": 1,
        "seed": 42,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 8,
        "learning_rate": 0.05,
        "num_train_epochs": 2,
    }
    values.update(overrides)
    return impl.TrainingArguments(**values)


class LossLoggerCallback(TrainerCallback):
    """A user's callback that keeps the logged losses."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


class StepCounterCallback(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


class CrashAt(TrainerCallback):
    """Simulates a crash (an exception) at the end of one optimizer step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")
