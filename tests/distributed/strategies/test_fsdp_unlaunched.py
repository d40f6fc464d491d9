"""FSDP2 on one process started without a launcher: the process makes its own group of one and trains.

A plain ``python script.py`` with ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())`` trains to the weights
of the same script under ``torchrun --nproc_per_node 1`` and under ``trainer-ext launch --num_processes 1`` (which
starts one process directly); the Trainer with ``fsdp="full_shard"`` trains the same way. The group of one sets the
launcher's variables while it lives and puts them back when it goes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.distributed.strategies import fsdp_unlaunched_job as job
from tests.helpers.ranks import child_env
from tests.helpers.tiny import tiny_llama
from trainer_ext.distributed.state import DistState, detect_topology

MODULE = job.__name__
STARTS = {
    "python": [sys.executable, "-m", MODULE],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", MODULE],
    "launch": [sys.executable, "-m", "trainer_ext", "launch", "--num_processes", "1", "--cpu", "-m", MODULE],
}


def _start(how: str, out: Path, kind: str) -> dict:
    env = child_env()
    env["OMP_NUM_THREADS"] = "1"
    for name in job.LAUNCHER_VARS:
        env.pop(name, None)
    proc = subprocess.run([*STARTS[how], str(out), kind], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{how} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    return json.loads((out / "facts.json").read_text())


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "weights.safetensors"))


@pytest.mark.timeout(600)
def test_accelerator_fsdp_plugin_trains_in_a_plain_process_like_under_torchrun(tmp_path: Path) -> None:
    facts = {how: _start(how, tmp_path / how, "loop") for how in STARTS}
    for how, seen in facts.items():
        assert seen["distributed_type"] == "FSDP" and seen["all_dtensors"], how
        assert seen["world_size"] == 1 and seen["env"]["RANK"] == "0" and seen["env"]["WORLD_SIZE"] == "1", how
        assert int(seen["env"]["MASTER_PORT"]) > 0, how
    assert facts["python"]["env"]["MASTER_ADDR"] == facts["launch"]["env"]["MASTER_ADDR"] == "127.0.0.1"
    reference = _weights(tmp_path / "torchrun")
    moved = max((reference[k] - v).abs().max().item() for k, v in tiny_llama(0).state_dict().items())
    assert moved > 1e-3, "training must move the weights"
    for how in ("python", "launch"):
        assert facts[how]["losses"] == facts["torchrun"]["losses"], how
        got = _weights(tmp_path / how)
        assert got.keys() == reference.keys()
        assert all(torch.equal(got[k], reference[k]) for k in reference), how


@pytest.mark.timeout(600)
def test_trainer_fsdp_full_shard_trains_in_a_plain_process(tmp_path: Path) -> None:
    facts = _start("python", tmp_path, "trainer")
    assert facts["distributed_type"] == "FSDP" and facts["all_dtensors"] and facts["world_size"] == 1
    assert facts["parallel_mode"] == "distributed"  # transformers' "FSDP needs a distributed run" check passes
    assert len(facts["losses"]) == 3 and all(loss == loss for loss in facts["losses"])
    assert (tmp_path / "checkpoint-2" / "model_sharded" / ".metadata").is_file()  # the format of N ranks
    trained = _weights(tmp_path)
    assert any(not torch.equal(trained[k], v) for k, v in tiny_llama(0).state_dict().items())


def test_group_of_one_sets_the_launcher_variables_and_puts_them_back(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    monkeypatch.setenv("MASTER_ADDR", "elsewhere")  # a stray value without a launcher: replaced, then restored
    state = DistState(detect_topology({}), cpu=True, init=False)
    assert not state.launched
    state.join_process_group()
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
        assert state.owns_process_group and state.single_process_group
        assert {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")} == {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
        }
        later = DistState(cpu=True)  # built after it, from the variables: the same world, the same group
        assert later.topology.world_size == 1 and later.launched
        later.join_process_group()
        assert not later.owns_process_group
    finally:
        state.destroy()
    assert not dist.is_initialized()
    assert os.environ["MASTER_ADDR"] == "elsewhere"
    assert all(name not in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
