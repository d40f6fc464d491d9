"""A shuffled ``dataloader_drop_last`` job whose batch count is not a multiple of the process count.

    python -m tests.parity.shuffle_drop_last_job OUT (ours|stock) [seedable|plain]    (1 process, or N under torchrun)

22 rows in batches of 4 make 5 batches per epoch: on 2 or 3 processes the last round is dropped. Every rank
writes ``OUT/rankN.json``: the sample ids it trained on, step by step, over 4 epochs; rank 0 adds the logged losses
and learning rates and the final weights. ``stock`` runs transformers' own Trainer (it needs accelerate); ``plain``
turns off the seedable sampler (``accelerator_config={"use_seedable_sampler": False}``): the processes then share one
generator that runs on from epoch to epoch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

ROWS, BATCH, EPOCHS = 22, 4, 4


class Rows(Dataset):
    """Regression rows that carry their own index (kept by the Trainer: the model's forward takes it)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.xs = torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.xs[i]
        return {"x": x, "labels": x.sum() * 0.5 + 0.1, "idx": torch.tensor(i)}


class Regression(nn.Module):
    """A linear regression that records which rows each forward saw."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = None
        self.linear = nn.Linear(4, 1)
        self.seen: list[list[int]] = []

    def forward(self, x: torch.Tensor, idx: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        if self.training:
            self.seen.append(idx.tolist())
        out = self.linear(x).squeeze(-1)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def main(out: str, impl: str, sampler: str = "seedable") -> None:
    if impl == "stock":
        from transformers import Trainer, TrainingArguments
    else:
        from trainer_ext import Trainer, TrainingArguments
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS,
        dataloader_drop_last=True,
        learning_rate=0.05,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,  # stock trains data-parallel on CPU processes only with it
        disable_tqdm=True,
        seed=0,
        accelerator_config={"use_seedable_sampler": sampler == "seedable"},
    )
    model = Regression()
    trainer = Trainer(model=model, args=args, train_dataset=Rows(ROWS))
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    record: dict = {"seen": model.seen, "global_step": trainer.state.global_step}
    if rank == 0:
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        record["loss"] = [entry["loss"] for entry in logs]
        record["learning_rate"] = [entry["learning_rate"] for entry in logs]
        record["weights"] = {k: v.tolist() for k, v in model.state_dict().items()}
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:])
