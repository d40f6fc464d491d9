"""``ProjectConfiguration(save_on_each_node=True)``: ``save`` and ``save_model`` write from each node's local main
process, as accelerate's ``save`` does, instead of only from the global main process (a node without a shared disk)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer_ext import Accelerator, ProjectConfiguration
from trainer_ext.accelerator_checkpoints import CheckpointsMixin


@pytest.mark.parametrize(
    "each_node, main, local_main, writes",
    [
        (False, True, True, True),
        (False, False, True, False),  # node 2's local main: accelerate's default writes on the main process only
        (False, False, False, False),
        (True, True, True, True),
        (True, False, True, True),  # node 2's local main writes its own copy
        (True, False, False, False),
    ],
)
def test_the_writer_follows_accelerates_rule(each_node: bool, main: bool, local_main: bool, writes: bool) -> None:
    fake = SimpleNamespace(
        project_configuration=ProjectConfiguration(save_on_each_node=each_node),
        is_main_process=main,
        is_local_main_process=local_main,
    )
    assert CheckpointsMixin._writes_saves(fake) is writes


@pytest.mark.parametrize("each_node", [False, True])
def test_a_second_nodes_local_main_writes_only_with_save_on_each_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, each_node: bool
) -> None:
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(save_on_each_node=each_node))
    monkeypatch.setattr(Accelerator, "is_main_process", property(lambda self: False))  # rank 0 of node 2
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    accelerator.save({"w": torch.ones(2)}, tmp_path / "obj.pt")
    accelerator.save_model(model, tmp_path / "model")
    assert (tmp_path / "obj.pt").exists() is each_node
    assert (tmp_path / "model" / "model.safetensors").exists() is each_node
