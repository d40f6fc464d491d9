"""A loop as accelerate's FSDP examples write it, for ``trainer-ext launch --fsdp_config FILE``: it names no FSDP
settings itself. ``python fsdp_launch_job.py OUT`` writes ``OUT/rank<r>.json``: what the Accelerator and a
TrainingArguments built in the script saw, how the model was sharded, the loop's losses and the gathered weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer_ext import Accelerator, TrainingArguments


def main(out: Path) -> None:
    accelerator = Accelerator()
    plugin = accelerator.state.fsdp_plugin
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    model = accelerator.prepare(model)  # FSDP's order: the model first, then an optimizer over its shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    optimizer, loader = accelerator.prepare(optimizer, loader)
    first = accelerator.unwrap_model(model)[0].weight
    losses = []
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    state = accelerator.get_state_dict(model)
    args = TrainingArguments(output_dir=str(out / "trainer"), report_to=[])
    info = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type.value),
        "plugin": None
        if plugin is None
        else {"reshard_after_forward": plugin.reshard_after_forward, "state_dict_type": plugin.state_dict_type.name},
        "local_rows": int(first.to_local().shape[0]) if hasattr(first, "to_local") else int(first.shape[0]),
        "losses": losses,
        "weights": {k: v.float().flatten().tolist() for k, v in state.items()} if accelerator.is_main_process else {},
        "trainer_arguments_fsdp": args.fsdp_plugin_args,
    }
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(info))
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
