"""Two gloo processes load folders in accelerate's ``save_state`` layout (test_accelerate_checkpoints.py).

``python -m tests.checkpointing.accelerate_migration_job OUT`` under torchrun:

- ``crafted``: a folder saved by 2 processes whose ``random_states_1.pkl`` would run code if unpickled in full;
  every process's ``load_state`` error message (process 1 reads the file, process 0 must not go on alone).
- ``fsdp``: a tiny Llama trained one AdamW step by plain torch, written as accelerate writes it under DDP
  (``module.`` names, whole files), loaded into ``Accelerator(fsdp_config=...)``: whether the gathered weights
  and the optimizer's whole ``exp_avg`` equal what was written, and the step counter.

Process 0 writes ``OUT/results.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from tests.checkpointing import accelerate_layout as layout
from tests.helpers.tiny import tiny_llama
from trainer_ext import Accelerator
from trainer_ext.errors import ConfigError

FSDP = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}


def crafted(out: Path) -> list[str]:
    accelerator = Accelerator(cpu=True)
    model = tiny_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    folder = out / "crafted"
    if accelerator.is_main_process:
        layout.write(folder, model, optimizer, processes=2)
        torch.save(
            {**layout.random_states(), "random_state": layout.Touch(out / "code_ran")}, folder / "random_states_1.pkl"
        )
    accelerator.wait_for_everyone()
    model, optimizer = accelerator.prepare(model, optimizer)
    try:
        accelerator.load_state(str(folder))
    except ConfigError as error:
        message = str(error)
    else:
        message = "loaded"
    gathered: list[Any] = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(gathered, message.replace(str(folder), "<DIR>"))
    accelerator.wait_for_everyone()  # the process group stays for the next part (torchrun's store is not made for a
    # second rendezvous); it is torn down at exit
    return gathered


def fsdp(out: Path) -> dict[str, Any]:
    plain = tiny_llama(0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain(input_ids=torch.arange(3, 15).view(2, 6), labels=torch.arange(3, 15).view(2, 6)).loss.backward()
    optimizer.step()
    folder = out / "ddp_written"
    accelerator = Accelerator(cpu=True, fsdp_config=FSDP)
    if accelerator.is_main_process:
        layout.write(folder, plain, optimizer, prefix="module.", processes=2, step=3)
    accelerator.wait_for_everyone()
    model = tiny_llama(1)  # other weights: all of them must come from the folder
    model, sharded_optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    accelerator.load_state(str(folder))
    weights = accelerator.get_state_dict(model)  # whole on process 0 (which reports), empty on the others
    whole = get_optimizer_state_dict(
        model, sharded_optimizer.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    names = [name for name, _ in plain.named_parameters()]
    saved = optimizer.state_dict()["state"]
    result = {
        "weights_equal": not accelerator.is_main_process
        or all(torch.equal(weights[k], v) for k, v in plain.state_dict().items()),
        "exp_avg_equal": all(torch.equal(whole["state"][names[i]]["exp_avg"], s["exp_avg"]) for i, s in saved.items()),
        "step": accelerator.step,
    }
    accelerator.wait_for_everyone()
    return result


def results(out: Path) -> dict[str, Any]:
    return json.loads((out / "results.json").read_text())


def main() -> None:
    out = Path(sys.argv[1])
    found = {"crafted": crafted(out), "fsdp": fsdp(out)}
    if torch.distributed.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
