"""Parallel layouts that cannot run are refused in one ``ConfigError`` line naming the numbers, before
torch.distributed is initialised: ``TrainingArguments`` and ``Accelerator`` in this process with a launcher's
variables for a world of 2 or 4 processes (no rendezvous address, so reaching the process group would fail with
torch's own error instead), and ``trainer-ext train`` started by such a launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers.ranks import child_env
from trainer_ext import Accelerator, TrainingArguments
from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.errors import ConfigError

DEEPSPEED = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}


@pytest.fixture(autouse=True)
def _world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No parallelism variables of a launch; the variables the refused set-up added are dropped again (a later rank
    run is forked from the warm server only while the environment is the one it started with)."""
    for name in list(os.environ):
        if name.startswith("PARALLELISM_CONFIG_") or name == "ACCELERATE_USE_PARALLELISM_CONFIG":
            monkeypatch.delenv(name)
    before = set(os.environ)
    yield
    for name in set(os.environ) - before:
        del os.environ[name]


def world(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """This process as rank 0 of ``size`` started by torchrun, without MASTER_ADDR/MASTER_PORT."""
    for name, value in dict(WORLD_SIZE=size, RANK=0, LOCAL_RANK=0, LOCAL_WORLD_SIZE=size).items():
        monkeypatch.setenv(name, str(value))


def refused(make: Callable[[], object], *parts: str) -> str:
    with pytest.raises(ConfigError) as caught:
        make()
    message = str(caught.value)
    assert "\n" not in message and all(part in message for part in parts), message
    assert not dist.is_initialized()
    return message


def args(tmp_path: Path, **kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


@pytest.mark.parametrize("sizes", [dict(dp_shard_size=2, tp_size=2), dict(tp_size=3)])
def test_sizes_that_do_not_multiply_to_the_world(monkeypatch, tmp_path, sizes) -> None:
    world(monkeypatch, 2)
    total = str(sizes.get("dp_shard_size", 1) * sizes["tp_size"])
    parts = (f"spans {total} processes", "the job has 2", f"launch {total} processes")
    refused(lambda: args(tmp_path, parallelism_config=ParallelismConfig(**sizes)), *parts)
    refused(lambda: Accelerator(cpu=True, parallelism_config=ParallelismConfig(**sizes)), *parts)


def test_context_parallelism_with_deepspeed_or_forced_torch_backend_on_cpu(monkeypatch, tmp_path) -> None:
    world(monkeypatch, 2)
    cp2 = ParallelismConfig(cp_size=2)
    refused(lambda: args(tmp_path, deepspeed=DEEPSPEED, parallelism_config=cp2), "DeepSpeed", "cp_size=2")
    forced = {"cp_size": 2, "cp_backend": "torch"}
    refused(lambda: Accelerator(cpu=True, parallelism_config=forced), "cp_backend='torch'", "'all_gather'")


def test_tensor_parallelism_with_deepspeed(monkeypatch, tmp_path) -> None:
    world(monkeypatch, 2)
    tp2 = ParallelismConfig(tp_size=2)
    refused(lambda: args(tmp_path, deepspeed=DEEPSPEED, parallelism_config=tp2), "DeepSpeed", "tp_size=2")
    refused(
        lambda: Accelerator(cpu=True, deepspeed_config=DEEPSPEED, parallelism_config=tp2), "DeepSpeed", "tp_size=2"
    )


def test_fsdp_with_replication_alone(monkeypatch, tmp_path) -> None:
    world(monkeypatch, 2)
    refused(
        lambda: args(tmp_path, fsdp="full_shard", parallelism_config=ParallelismConfig(dp_replicate_size=2)),
        "dp_replicate_size=2 alone",
        "set dp_shard_size",
    )


def test_train_refuses_kv_heads_tp_size_does_not_divide_before_the_process_group(tmp_path) -> None:
    """``trainer-ext train --tp_size 4`` as rank 0 of 4 started by torchrun: the tiny Llama preset's 2 KV heads are
    refused by name, exit 2, before the rendezvous (which has no address here)."""
    env = child_env()
    env.update(WORLD_SIZE="4", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4", OMP_NUM_THREADS="1")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "trainer_ext", "train", "--task", "causal-lm", "--tp_size", "4"]
    proc = subprocess.run(
        [*cmd, "--output_dir", str(tmp_path / "run")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    problems = [line for line in proc.stderr.splitlines() if "num_key_value_heads (2)" in line]
    assert problems and "divisible by 4" in problems[0], proc.stderr[-3000:]
    assert "MASTER_ADDR" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
