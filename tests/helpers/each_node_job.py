"""``python -m tests.helpers.each_node_job OUT_DIR`` on 2 nodes of 1 process: ``save`` and ``save_model`` into
``OUT_DIR/<each_node>/node<N>`` (a per-node disk), with ``save_on_each_node`` off and on."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from trainer_ext import Accelerator, ProjectConfiguration


def main(out: str) -> None:
    node = os.environ["GROUP_RANK"]
    for each_node in (False, True):
        accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(save_on_each_node=each_node))
        assert accelerator.is_local_main_process and accelerator.num_processes == 2
        model = accelerator.prepare(torch.nn.Linear(2, 1))
        folder = Path(out) / str(each_node) / f"node{node}"
        folder.mkdir(parents=True, exist_ok=True)
        accelerator.save({"w": torch.ones(2)}, folder / "obj.pt")
        accelerator.save_model(model, folder / "model")
        accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
