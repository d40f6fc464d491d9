"""Models and data for the ``--auto_find_batch_size`` tests, and their 2-rank job.

The only stand-in is the out-of-memory error: :class:`Memory` hooks a real model to raise
``torch.OutOfMemoryError`` when a training forward (or its backward) sees more rows than a limit.
``python -m tests.distributed.auto_batch_job OUT_DIR`` under torchrun: rank 0 alone runs out of memory (in forward, then in a
non-final backward of a window); rank 0 writes the weights and the per-rank counts to OUT_DIR.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from trainer_ext import Trainer, TrainingArguments


class Regressor(nn.Module):
    """Two linear layers and a mean squared error: a per-row mean loss (the Trainer divides by accumulation).

    The buffer (ones) makes DDP broadcast buffers in forward, as it does for most transformers models.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(6, 16)
        self.outer = nn.Linear(16, 1)
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.outer(torch.tanh(self.inner(x * self.scale)))
        return {"loss": nn.functional.mse_loss(prediction, labels)}


class Rows(torch.utils.data.Dataset):
    """``n`` rows of a noisy linear target."""

    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 6, generator=g)
        self.y = self.x @ torch.randn(6, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Memory:
    """Raises ``torch.OutOfMemoryError`` for more than ``limit`` rows in training, in forward or in backward.

    ``after``: the first this many training forwards fit whatever their size (memory that fills up later).
    """

    def __init__(self, limit: int, in_backward: bool = False, after: int = 0) -> None:
        self.limit, self.in_backward, self.after = limit, in_backward, after
        self.forwards = self.raised = 0

    def attach(self, model: nn.Module, layer: nn.Module) -> nn.Module:
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        layer.register_forward_hook(self._after_layer)
        return model

    def _too_big(self, rows: int) -> bool:
        return rows > self.limit and self.forwards > self.after

    def _raise(self, rows: int) -> None:
        self.raised += 1
        raise torch.OutOfMemoryError(f"simulated: out of memory for {rows} rows (limit {self.limit})")

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training:
            return
        self.forwards += 1
        rows = next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)).shape[0]
        if not self.in_backward and self._too_big(rows):
            self._raise(rows)

    def _after_layer(self, module: nn.Module, args: tuple, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if self.in_backward and module.training and hidden.requires_grad:
            rows, too_big = hidden.shape[0], self._too_big(hidden.shape[0])

            def in_backward(grad: torch.Tensor) -> None:
                if too_big:  # the outer layer's gradients are already accumulated: a partial backward
                    self._raise(rows)

            hidden.register_hook(in_backward)


# name: (out of memory in backward, accumulation steps, forwards that fit first)
JOBS = {
    "forward": (False, 2, 0),
    "forward_at_boundary": (False, 2, 1),  # the window's earlier micro-batch runs again, without syncing
    "backward": (True, 2, 0),  # at a window's first micro-batch, which does not sync
    "forward_every_step": (False, 1, 0),
}


def two_rank_job(out: Path, in_backward: bool, accumulation: int, after: int) -> tuple[dict[str, torch.Tensor], int]:
    """Batch 8 on each rank; only rank 0 runs out of memory above 4 rows."""
    model = Regressor()
    limit = 4 if int(os.environ.get("RANK", "0")) == 0 else 1 << 30
    memory = Memory(limit, in_backward=in_backward, after=after)
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        report_to=[],
        num_train_epochs=2,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        auto_find_batch_size=True,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=accumulation,
    )
    trainer = Trainer(model=memory.attach(model, model.inner), args=args, train_dataset=Rows(64))
    trainer.train()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    return {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}, memory.raised


def main(out: str) -> None:
    out_dir = Path(out)
    results = {}
    for name, (in_backward, accumulation, after) in JOBS.items():
        weights, raised = two_rank_job(out_dir / name, in_backward, accumulation, after)
        counts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(counts, raised)
        results[name] = counts
        if torch.distributed.get_rank() == 0:
            save_file(weights, str(out_dir / f"{name}.safetensors"))
    if torch.distributed.get_rank() == 0:
        (out_dir / "results.json").write_text(json.dumps(results))
    gc.collect()  # drop the DDP reducers before the group goes
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
