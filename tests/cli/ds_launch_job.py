"""A script as accelerate's DeepSpeed examples write it, for ``trainer-ext launch --deepspeed FILE``: it names no
DeepSpeed config itself. ``python ds_launch_job.py OUT`` writes ``OUT/rank<r>.json``: what the Accelerator and a
TrainingArguments built in the script saw, and the loop's losses and LRs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer_ext import Accelerator, DummyOptim, DummyScheduler, TrainingArguments


def main(out: Path) -> None:
    accelerator = Accelerator()
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    total = len(loader)
    if "optimizer" in config:
        optimizer = DummyOptim(model.parameters(), lr=0.05)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    if "scheduler" in config:
        scheduler = DummyScheduler(optimizer, total_num_steps=total, warmup_num_steps=2)
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses, lrs = [], []
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        lrs.append(scheduler.get_last_lr()[0])
    args = TrainingArguments(output_dir=str(out / "trainer"), report_to=[])
    info = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type.value),
        "zero_stage": accelerator.deepspeed_plugin.zero_stage,
        "variable": os.environ.get("TRAINER_EXT_DEEPSPEED_CONFIG"),
        "losses": losses,
        "lrs": lrs,
        "trainer_arguments_deepspeed": args.deepspeed,
        "trainer_arguments_stage": args.hf_deepspeed_config.stage if args.hf_deepspeed_config else None,
    }
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(info))
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
