"""Two ranks save a checkpoint, then save again with the main process's disk full (simulated).

argv: OUT_DIR. Each rank writes ``result_<rank>.json``: what the second save raised, how long it took, and
whether the first checkpoint still loads.
"""

from __future__ import annotations

import errno
import json
import sys
import time
from pathlib import Path

import torch

from trainer_ext import Accelerator
from trainer_ext.checkpointing import loop_state as checkpoint

out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
target = out / "state"
accelerator.save_state(target)
saved = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)

if accelerator.is_main_process:

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    checkpoint.save_file = full_disk
start = time.monotonic()
try:
    accelerator.save_state(target)
    raised = None
except Exception as exc:
    raised = f"{type(exc).__name__}: {exc}"
waited = time.monotonic() - start
accelerator.load_state(target)
same = all(torch.equal(v, saved[k]) for k, v in accelerator.unwrap_model(model).state_dict().items())
result = {"raised": raised, "waited": waited, "previous_loads": same}
(out / f"result_{accelerator.process_index}.json").write_text(json.dumps(result))
