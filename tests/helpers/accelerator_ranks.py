"""accelerate's process API on trainer_ext.Accelerator across real gloo ranks.

``python -m tests.helpers.accelerator_ranks OUT`` (under torchrun): splitting inputs, decorators, the trigger,
``join_uneven_inputs`` on uneven data, the scheduler rule and its opt-out, the DDP kwargs handler, split batches,
an iterable dataset; every rank's observations gathered into ``OUT/results.json`` by rank 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from trainer_ext import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs


def _schedule(counts_optimizer_steps: bool) -> dict[str, Any]:
    """The examples' schedule, sized from the unsharded loader: 16 samples, batch 2, 1 epoch -> 8 LR steps."""
    accelerator = Accelerator(cpu=True, scheduler_counts_optimizer_steps=counts_optimizer_steps)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = torch.utils.data.DataLoader(torch.ones(16, 2), batch_size=2)
    total = len(loader)  # before prepare: the unsharded length
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        accelerator.backward(model(batch).sum())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {"optimizer_steps": len(loader), "lr": scheduler.get_last_lr()[0]}


def _uneven(accelerator: Accelerator) -> dict[str, Any]:
    """5 samples, batch 2, even_batches=False inside join_uneven_inputs: rank 0 reads 2 batches, rank 1 one."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.arange(10.0).reshape(5, 2), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = 0
    with accelerator.join_uneven_inputs([model], even_batches=False):
        for batch in loader:
            accelerator.backward(model(batch).sum())
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    weight = accelerator.unwrap_model(model).weight.detach().flatten().tolist()
    return {"steps": steps, "weight": weight, "even_after": accelerator.even_batches}


def _iterable() -> list[list[int]]:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(10)

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    loader = accelerator.prepare(torch.utils.data.DataLoader(Stream(), batch_size=2))
    return [batch.tolist() for batch in loader]


def main(out: Path) -> None:
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    seen: dict[str, Any] = {}
    with accelerator.split_between_processes(["A", "B", "C", "D", "E"]) as part:
        seen["split"] = part
    with accelerator.split_between_processes(["A", "B", "C", "D", "E"], apply_padding=True) as part:
        seen["split_padded"] = part
    with accelerator.split_between_processes({"x": [1, 2, 3], "y": torch.tensor([4, 5, 6])}) as part:
        seen["split_dict"] = {"x": part["x"], "y": part["y"].tolist()}
    seen["on_main"] = accelerator.on_main_process(lambda: rank)()
    seen["on_last"] = accelerator.on_last_process(lambda: rank)()
    seen["on_process_1"] = accelerator.on_process(lambda: rank, process_index=1)()
    seen["on_local_process_0"] = accelerator.on_local_process(local_process_index=0)(lambda: rank)()
    if rank == 1:
        accelerator.set_trigger()
    seen["trigger"] = [accelerator.check_trigger(), accelerator.check_trigger()]
    seen["schedule_accelerate"] = _schedule(False)
    seen["schedule_once"] = _schedule(True)
    seen["uneven"] = _uneven(accelerator)
    ddp = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    seen["ddp_find_unused"] = bool(ddp.prepare(torch.nn.Linear(2, 2)).find_unused_parameters)
    split = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    seen["split_batches"] = [
        b.tolist() for b in split.prepare(torch.utils.data.DataLoader(torch.arange(8), batch_size=4))
    ]
    seen["iterable"] = _iterable()
    gathered: list[Any] = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(gathered, seen)
    if rank == 0:
        (out / "results.json").write_text(json.dumps(gathered))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
