"""Rank job: gathers on a process group started with no backend named, as transformers' ``__post_init__`` starts it
under TRL's parser (``get_backend()`` says ``undefined``), of views that carry gradients, as DPO's ``chosen_logps``.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.distributed.unnamed_backend_gather_job OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from trainer_ext.distributed import collectives
from trainer_ext.distributed.engine import Engine
from trainer_ext.distributed.state import DistState


def main(out: str) -> None:
    dist.init_process_group()  # no backend named
    engine = Engine(DistState())
    rank = dist.get_rank()
    logits = (torch.arange(8.0).reshape(4, 2) + 100 * rank).requires_grad_()
    chosen, rejected = (logits * 2).chunk(2)  # views of a tensor in the autograd graph
    results = {
        "backend": str(dist.get_backend()),
        "gather": engine.gather(chosen).tolist(),
        "gather_for_metrics": engine.gather_for_metrics(rejected.mean(dim=1)).tolist(),
        "gather_forms": [collectives._gather_tensor(chosen, into_one=form).tolist() for form in (False, None)],
        "needs_grad": engine.gather(chosen).requires_grad,
        "padded": engine.pad_across_processes(chosen[: rank + 1], dim=0).tolist(),
    }
    (chosen.sum() + rejected.sum()).backward()  # the graph is intact after the gathers
    results["grad"] = logits.grad.tolist()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    engine.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
