"""Run under torchrun: every rank dispatches its own copy of the test model over CPU and disk.

``python -m tests.inference.dispatch_ranks OUT_DIR OFFLOAD_DIR``: each rank generates for its half of the prompts;
rank 0 writes all tokens, the per-rank default budgets and the offload folders to OUT_DIR/result.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.inference.dispatch_models import make_llama, prompt
from trainer_ext.inference import dispatch_model
from trainer_ext.inference.devices import resolve_max_memory


def main(out: Path, offload_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = dispatch_model(make_llama(), max_memory={"cpu": "200KB"}, offload_dir=offload_dir, print_summary=False)
    ids = prompt(batch=4).chunk(world)[rank]
    tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    gathered = [torch.empty_like(tokens) for _ in range(world)]
    dist.all_gather(gathered, tokens)
    budgets = [None] * world
    dist.all_gather_object(budgets, resolve_max_memory(None))
    if rank == 0:
        result = {
            "tokens": torch.cat(gathered).tolist(),
            "budgets": [{str(k): v for k, v in b.items()} for b in budgets],
            "folders": sorted(os.listdir(offload_dir)),
            "device_map": {k: str(v) for k, v in model.hf_device_map.items()},
        }
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
