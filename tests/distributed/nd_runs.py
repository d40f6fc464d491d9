"""The launches of :mod:`tests.distributed.nd_job` that the N-D Trainer and Accelerator tests share: each runs once
per pytest session (four launches in all: TP 2, one process, FSDP2 × TP 2×2, HSDP 2×2) and its results are read
by every test that needs them."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.ranks import launch_once

JOB = "tests.distributed.nd_job"
# name -> (processes, dp_replicate,dp_shard,tp, tasks); "from=" resumes the TP 2 run's checkpoint-5
LAUNCHES = {
    "tp2": (2, "1,1,2", ("train", "eval", "same_mesh", "qwen2", "loop")),
    "one": (1, "1,1,1", ("train", "eval", "from=", "qwen2", "loop")),
    "fsdp_tp": (4, "1,2,2", ("train", "eval", "from=", "loop")),
    "hsdp": (4, "2,2,1", ("train",)),
}


def launched(root: Path, name: str) -> Path:
    """The output folder of launch ``name`` under ``root``, run on first use (a failed launch fails every test that
    reads it, without running it again)."""
    nproc, sizes, tasks = LAUNCHES[name]
    if "from=" in tasks:
        tasks = tuple(f"from={launched(root, 'tp2')}" if t == "from=" else t for t in tasks)
    return launch_once(root / name, name, JOB, nproc, sizes, *tasks)


def seen(out: Path, name: str) -> dict:
    """What rank 0 of a launch recorded for task ``name``."""
    return torch.load(out / f"{name}.pt", weights_only=False)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def run_diff(a: dict, b: dict) -> dict[str, float]:
    """The largest differences of two runs' logged losses, gradient norms and final weights."""
    assert len(a["losses"]) == len(b["losses"]) and len(a["norms"]) == len(b["norms"]), (a["losses"], b["losses"])
    return {
        "loss": max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)),
        "norm": max(abs(x - y) for x, y in zip(a["norms"], b["norms"], strict=True)),
        "weights": max_diff(a["weights"], b["weights"]),
    }


def assert_resumed_bitwise(out: Path) -> None:
    """The ``same_mesh`` run of launch folder ``out`` (resumed from the ``train`` run's checkpoint-5 on the same
    mesh) logged the same losses and norms over 10 steps and ended with equal weights."""
    uninterrupted, resumed = seen(out, "train"), seen(out, "same_mesh")
    assert resumed["steps"] == 10
    assert resumed["losses"] == uninterrupted["losses"] and resumed["norms"] == uninterrupted["norms"]
    assert resumed["weights"].keys() == uninterrupted["weights"].keys()
    unequal = [k for k, w in resumed["weights"].items() if not torch.equal(w, uninterrupted["weights"][k])]
    assert not unequal, unequal
