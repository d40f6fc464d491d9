"""``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)``: the oldest checkpoints are deleted only
once the new one is committed, so a save that fails (a write error) or is killed (SIGKILL) keeps the previous one
loadable; successful saves leave the folders accelerate's rotation leaves."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import child_env
from trainer_ext import Accelerator, ProjectConfiguration

pytestmark = pytest.mark.timeout(240)
JOB = "tests.checkpointing.rotation_fault_job"


def _job(mode: str, out: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = child_env({**os.environ, "OMP_NUM_THREADS": "1"})
    done = subprocess.run(
        [sys.executable, "-m", JOB, mode, str(out)], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _assert_resumes_checkpoint_0(out: Path) -> None:
    _job("resume", out)
    resumed = json.loads((out / "resumed.json").read_text())
    assert resumed["same"] == dict.fromkeys(("model", "optimizer", "scheduler", "count", "rng"), True)
    assert resumed["saved"] == "checkpoint_1"  # numbering continues after the checkpoint loaded
    assert resumed["after_save"] == ["checkpoint_1"]  # the leftover cleared, checkpoint_0 rotated away


@pytest.mark.slow
def test_a_write_error_in_the_second_save_keeps_checkpoint_0(tmp_path: Path) -> None:
    """The file-size limit makes every write past 1 KiB fail in the kernel (EFBIG), as a full disk does (ENOSPC)."""
    _job("fsize", tmp_path)
    failed = json.loads((tmp_path / "failed.json").read_text())
    assert "File too large" in failed["error"], failed  # EFBIG, from the kernel
    assert failed["left"] == [".checkpoint_1.saving", "checkpoint_0"], failed  # nothing rotated away
    assert failed["iteration"] == 1  # the failed save did not count
    _assert_resumes_checkpoint_0(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["hang-hook", "hang-object"])
def test_a_sigkill_during_the_second_save_keeps_checkpoint_0(tmp_path: Path, where: str) -> None:
    """Killed while the second save is being written: before any file (in a pre-hook), or after the model and
    optimizer files (in a registered object's state_dict)."""
    env = child_env({**os.environ, "OMP_NUM_THREADS": "1"})
    job = subprocess.Popen(
        [sys.executable, "-m", JOB, where, str(tmp_path)], stderr=subprocess.PIPE, text=True, env=env
    )
    staging = tmp_path / "project" / "checkpoints" / ".checkpoint_1.saving"
    deadline = time.monotonic() + 120
    try:
        while not ((tmp_path / "blocked").exists() and staging.is_dir()):
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.05)
        job.send_signal(signal.SIGKILL)
        assert job.wait(timeout=60) == -signal.SIGKILL
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        job.stderr.close()
    left = sorted(p.name for p in staging.parent.iterdir())
    assert left == [".checkpoint_1.saving", "checkpoint_0"], left
    _assert_resumes_checkpoint_0(tmp_path)


class Failing:
    """A registered object whose ``state_dict`` fails as a write to a full disk does, while ``full`` is set."""

    def __init__(self) -> None:
        self.full = False
        self.value = torch.zeros(1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return {"value": self.value.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.value = state["value"].clone()


def _prepared(project: Path, total_limit: int | None, iteration: int = 0):
    config = ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=total_limit, iteration=iteration
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Linear(4, 2)
    failing = Failing()
    accelerator.register_for_checkpointing(failing)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return accelerator, model, optimizer, failing


def _step(accelerator: Accelerator, model, optimizer) -> None:
    accelerator.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    optimizer.zero_grad()


def _names(project: Path) -> list[str]:
    return sorted(p.name for p in (project / "checkpoints").iterdir())


def test_an_error_in_the_second_save_keeps_the_previous_and_the_retry_rotates(tmp_path: Path) -> None:
    accelerator, model, optimizer, failing = _prepared(tmp_path, total_limit=1)
    _step(accelerator, model, optimizer)
    accelerator.save_state()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _step(accelerator, model, optimizer)
    failing.full = True
    with pytest.raises(OSError, match="No space left"):
        accelerator.save_state()
    assert _names(tmp_path) == [".checkpoint_1.saving", "checkpoint_0"]
    accelerator.load_state()
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    failing.full = False
    assert Path(accelerator.save_state()).name == "checkpoint_1"
    assert _names(tmp_path) == ["checkpoint_1"]


@pytest.mark.parametrize(
    ("existing", "iteration", "limit", "left"),
    [
        ([], 0, 2, ["checkpoint_0"]),
        ([0, 1], 2, 2, ["checkpoint_1", "checkpoint_2"]),
        ([0, 1, 2], 3, 1, ["checkpoint_3"]),
        ([5], 0, 1, ["checkpoint_0"]),  # iteration set back by hand: accelerate deletes by number, the new stays
        ([0, 1], 1, 1, ["checkpoint_1"]),  # the folder reused is among those deleted: it is replaced
        ([0, 1], 3, None, ["checkpoint_0", "checkpoint_1", "checkpoint_3"]),
    ],
)
def test_successful_saves_leave_the_folders_accelerate_leaves(
    tmp_path: Path, existing: list[int], iteration: int, limit: int | None, left: list[str]
) -> None:
    """The folders after a save, as accelerate's rotation (delete the oldest by number, then save) leaves them."""
    for number in existing:
        accelerator, *_ = _prepared(tmp_path, total_limit=None, iteration=number)
        accelerator.save_state()
    accelerator, model, optimizer, _ = _prepared(tmp_path, total_limit=limit, iteration=iteration)
    _step(accelerator, model, optimizer)
    path = Path(accelerator.save_state())
    assert path.name == f"checkpoint_{iteration}"
    assert _names(tmp_path) == left
    assert accelerator.save_iteration == iteration + 1
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _step(accelerator, model, optimizer)
    accelerator.load_state(path)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_a_failed_save_into_a_reused_folder_keeps_both(tmp_path: Path) -> None:
    """``iteration`` pointing at an existing folder that the rotation deletes: a failed save keeps it and the
    older one (the new one would have replaced it whole)."""
    for number in (0, 1):
        accelerator, *_ = _prepared(tmp_path, total_limit=None, iteration=number)
        accelerator.save_state()
    accelerator, model, optimizer, failing = _prepared(tmp_path, total_limit=1, iteration=1)
    failing.full = True
    with pytest.raises(OSError, match="No space left"):
        accelerator.save_state()
    assert [n for n in _names(tmp_path) if not n.startswith(".")] == ["checkpoint_0", "checkpoint_1"]
    accelerator.load_state(tmp_path / "checkpoints" / "checkpoint_1")


def test_a_foreign_folder_reused_by_number_is_put_back_when_the_save_fails(tmp_path: Path) -> None:
    """A ``checkpoint_0`` not written by us (accelerate's, say) that the rotation deletes for the new
    ``checkpoint_0``: set aside during the save, back in place when it fails, deleted once a save succeeds."""
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"theirs")
    accelerator, model, optimizer, failing = _prepared(tmp_path, total_limit=1)
    failing.full = True
    with pytest.raises(OSError, match="No space left"):
        accelerator.save_state()
    assert (folder / "model.safetensors").read_bytes() == b"theirs"
    assert [n for n in _names(tmp_path) if not n.startswith(".")] == ["checkpoint_0"]
    failing.full = False
    assert Path(accelerator.save_state()).name == "checkpoint_0"
    assert _names(tmp_path) == ["checkpoint_0"]  # accelerate's result: the old one deleted, the new one there
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _step(accelerator, model, optimizer)
    accelerator.load_state(folder)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
