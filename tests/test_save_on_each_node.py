"""``ProjectConfiguration(save_on_each_node=True)``: ``save`` and ``save_model`` write from each node's local main
process, as accelerate's ``save`` does, instead of only from the global main process (a node without a shared disk)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.ranks import child_env
from trainer_ext import Accelerator, ProjectConfiguration
from trainer_ext.accelerator.checkpoints import writes_saves


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
    assert writes_saves(fake) is writes


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_nodes_each_write_their_copy(tmp_path: Path) -> None:
    """Two torchrun launches of one process each (node ranks 0 and 1): both are their node's local main process."""
    port, env = _free_port(), child_env()
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    launches = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
             "--rdzv_backend=static", "--master_addr=127.0.0.1", f"--master_port={port}", "--max_restarts=0",
             "-m", "tests.helpers.each_node_job", str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]  # fmt: skip
    outputs = [launch.communicate(timeout=240)[0] for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    for each_node, nodes in (("False", ["node0"]), ("True", ["node0", "node1"])):
        for node in ("node0", "node1"):
            written = (tmp_path / each_node / node / "obj.pt").exists()
            model = (tmp_path / each_node / node / "model" / "model.safetensors").exists()
            assert written is model is (node in nodes), (each_node, node)
