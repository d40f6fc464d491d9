"""Migrating a running job: a loop started under stock accelerate 1.15 saves with its ``save_state``; a new process
with ``trainer_ext.Accelerator`` (accelerate hidden from the import system) ``load_state``s that folder, calls
``skip_first_batches`` as accelerate's checkpointing example does, and continues, on 1 and 2 gloo processes.

- ``explicit`` (unshuffled, no dropout: stock's resume continues its uninterrupted run exactly): ours resumed from
  the ``safe_serialization=True`` folder and from the ``=False`` one equals, step for step (sample ids, loss, LR)
  and in the final weights, both the uninterrupted stock run and stock's own resumed run.
- ``automatic`` (``automatic_checkpoint_naming``, shuffled, dropout, 2 accumulation steps, saved mid-window):
  ``load_state()`` picks ``checkpoint_1``; ours continues exactly as stock's own resume of the same folder does
  (which is not the uninterrupted run: accelerate's resume draws the resumed pass's seeds anew), and its next save
  is ``checkpoint_2`` without ``iteration`` set by hand (stock needs ``iteration=2``, else its save collides).

Both log accelerate's progress lines, in its words; ours also says, once, that the folder is accelerate's.
Exact equality throughout (CPU, fp32, one thread per process). Needs accelerate: skipped without it unless
``TRAINER_EXT_REQUIRE_ACCELERATE=1``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.ranks import child_env
from tests.helpers.stock_side import require_accelerate, skip_without_accelerate

pytestmark = [
    pytest.mark.parity,
    pytest.mark.distributed,
    pytest.mark.timeout(900),
    skip_without_accelerate("run in the side venv (tests/accelerator_parity/README.md)"),
]
JOB = "tests.accelerator_parity.migrate_job"
NOTICE = "loading accelerate checkpoint"
# accelerate's progress lines (after "[RANK 0] "), compared between stock and ours with the folders blanked
PROGRESS = re.compile(
    r"\[RANK 0\] ((Saving current state to|Model weights saved in|Optimizer state saved in|Scheduler state saved in|"
    r"Random states saved in|Saving the state of|Loading states from|All .* loaded successfully|Loading in|"
    r"Loading the state of).*)"
)


def launch(nproc: int, out: Path, *args: str) -> str:
    """One phase on ``nproc`` gloo processes under ``python -m torch.distributed.run``; its output."""
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["--max_restarts=0", "-m", JOB, "--out", str(out), *args]
    env = child_env()
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    (out / "log.txt").write_text(text)
    assert proc.returncode == 0, f"{' '.join(args)} on {nproc} process(es) failed:\n{text[-4000:]}"
    return text


def ranks(out: Path, nproc: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def tensors(out: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"{name}.st"))


def tail(full: dict[str, Any], resumed: dict[str, Any]) -> list[dict[str, Any]]:
    """The uninterrupted run's steps from where the resumed one starts."""
    first = resumed["steps"][0]
    start = next(
        i for i, s in enumerate(full["steps"]) if (s["epoch"], s["batch"]) == (first["epoch"], first["batch"])
    )
    return full["steps"][start:]


def progress_lines(text: str, *folders: Path) -> list[str]:
    lines = [m.group(1) for m in PROGRESS.finditer(text)]
    for folder in folders:
        lines = [line.replace(str(folder), "<DIR>") for line in lines]
    return lines


def assert_same_run(ours: Path, reference: Path, nproc: int, what: str) -> None:
    """Every rank read the same batches with the same losses and LRs, and the final weights are equal (exactly)."""
    mine, theirs = ranks(ours, nproc), ranks(reference, nproc)
    for rank, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        expected = tail(b, a) if len(b["steps"]) != len(a["steps"]) else b["steps"]
        assert a["steps"] == expected, f"rank {rank}: ours resumed differs from {what}"
    for name, tensor in tensors(reference, "final").items():
        assert torch.equal(tensors(ours, "final")[name], tensor), f"final {name} differs from {what}"


def explicit(nproc: int, root: Path) -> dict[str, Any]:
    work = root / "work"
    full = launch(
        nproc,
        root / "stock_full",
        "--impl",
        "stock",
        "--variant",
        "explicit",
        "--phase",
        "full",
        "--workdir",
        str(work),
    )
    logs = {"stock_full": full}
    for name, impl, folder in (
        ("stock_resumed", "stock", "ck_safe"),
        ("ours_safe", "ours", "ck_safe"),
        ("ours_bin", "ours", "ck_bin"),
    ):
        logs[name] = launch(
            nproc,
            root / name,
            "--impl",
            impl,
            "--variant",
            "explicit",
            "--phase",
            "resumed",
            "--workdir",
            str(work),
            "--checkpoint",
            str(work / folder),
        )
    return logs


def automatic(nproc: int, root: Path) -> dict[str, Any]:
    base = root / "base"
    logs = {
        "stock_full": launch(
            nproc,
            root / "stock_full",
            "--impl",
            "stock",
            "--variant",
            "automatic",
            "--phase",
            "full",
            "--workdir",
            str(base),
        )
    }
    for impl in ("stock", "ours"):
        work = root / f"{impl}_work"
        shutil.copytree(base, work)
        extra = ["--iteration", "2"] if impl == "stock" else []  # stock's save would collide with checkpoint_0
        logs[f"{impl}_resumed"] = launch(
            nproc,
            root / f"{impl}_resumed",
            "--impl",
            impl,
            "--variant",
            "automatic",
            "--phase",
            "resumed",
            "--workdir",
            str(work),
            *extra,
        )
    return logs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], tuple[Path, dict[str, str]]]:
    """Every variant on 1 and 2 processes: its folder of phases and their output, two chains at a time."""
    # not skipped: CI requires accelerate
    require_accelerate("run in the side venv (tests/accelerator_parity/README.md)")
    root = tmp_path_factory.mktemp("migrate")
    chains = {
        (variant, nproc): root / f"{variant}-{nproc}" for variant in ("explicit", "automatic") for nproc in (1, 2)
    }
    steps = {"explicit": explicit, "automatic": automatic}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(steps[key[0]], key[1], folder) for key, folder in chains.items()}
        return {key: (chains[key], future.result()) for key, future in futures.items()}


@pytest.mark.parametrize("nproc", [1, 2])
def test_accelerate_checkpoint_continues_the_uninterrupted_run(runs: dict, nproc: int) -> None:
    root, logs = runs[("explicit", nproc)]
    stock_full, stock_resumed = root / "stock_full", root / "stock_resumed"
    assert_same_run(stock_resumed, stock_full, nproc, "stock's uninterrupted run")  # the premise: stock continues it
    for name in ("ours_safe", "ours_bin"):  # safe_serialization True and False
        assert_same_run(root / name, stock_full, nproc, "stock's uninterrupted run")
        assert_same_run(root / name, stock_resumed, nproc, "stock's resumed run")
        for mine, theirs in zip(ranks(root / name, nproc), ranks(stock_full, nproc), strict=True):
            assert mine["accelerate_imported"] is False
            at_save = theirs["at_save"]
            assert mine["after_load"]["rng"] == at_save["rng"]  # python, numpy and torch, per process
            assert (mine["after_load"]["step"], mine["after_load"]["lr"]) == (at_save["step"], at_save["lr"])
        for key, tensor in tensors(stock_full, "at_save").items():
            assert torch.equal(tensors(root / name, "after_load")[key], tensor)
        assert logs[name].count(NOTICE) == 1, logs[name][-3000:]  # said once, by the main process
        ours, theirs = (progress_lines(logs[n], root / "work") for n in (name, "stock_resumed"))
        assert ours == [line.replace("ck_safe", "ck_bin") if name == "ours_bin" else line for line in theirs]
    assert NOTICE not in logs["stock_resumed"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_automatic_naming_continues_as_stock_resumes_it(runs: dict, nproc: int) -> None:
    root, logs = runs[("automatic", nproc)]
    ours, stock = root / "ours_resumed", root / "stock_resumed"
    assert_same_run(ours, stock, nproc, "stock's resumed run")
    for mine, theirs in zip(ranks(ours, nproc), ranks(stock, nproc), strict=True):
        assert (
            mine["after_load"]["progress"]
            == theirs["after_load"]["progress"]
            == {"epoch": 1, "batches": 5 if nproc == 1 else 3}
        )
        assert mine["after_load"]["rng"] == theirs["after_load"]["rng"]
        assert mine["after_load"]["step"] == theirs["after_load"]["step"]  # mid-window: the next micro-step syncs
        assert mine["after_load"]["save_iteration"] == 2  # stock: 0 (set to 2 by hand here)
        assert mine["checkpoints"] == theirs["checkpoints"] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert ranks(ours, nproc)[0]["accelerate_imported"] is False
    for key, tensor in tensors(stock, "after_load").items():
        assert torch.equal(tensors(ours, "after_load")[key], tensor)
    assert logs["ours_resumed"].count(NOTICE) == 1
    mine, theirs = (
        progress_lines(logs["ours_resumed"], root / "ours_work"),
        progress_lines(logs["stock_resumed"], root / "stock_work"),
    )
    assert mine == theirs and any(
        "Saving current state to <DIR>/project/checkpoints/checkpoint_2" in line for line in mine
    )
