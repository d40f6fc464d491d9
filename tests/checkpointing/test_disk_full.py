"""A full disk, for real: a small tmpfs mounted for the test, filled before the start or in the middle of a run.

Full at the start: the job is refused before it writes anything (one error line naming the folder, the free space
and what is needed). Full in the middle of a save: one clear error instead of torch's ``basic_ios::clear``, the
unfinished checkpoint removed, the previous one intact and still resumable.

Mounting needs root (CI runs as root and sets ``TRAINER_EXT_REQUIRE_TMPFS=1``, which turns the skip into a failure).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import TrainerCallback

from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.checkpointing import verify
from trainer_ext.checkpointing.disk_space import DiskFullError, free_bytes
from trainer_ext.cli.main import main

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[callable]:
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            reason = f"cannot mount a tmpfs here ({done.stderr.decode().strip() or 'not root'})"
            if os.environ.get("TRAINER_EXT_REQUIRE_TMPFS") == "1":
                pytest.fail(reason)
            pytest.skip(reason)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_disk_too_full_to_start_refuses_before_writing(small_disk, capsys) -> None:
    disk = small_disk("256k")
    out = disk / "run"
    flags = ["--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1", "--report_plots", "false"]
    code = main(["train", "--output_dir", str(out), *flags])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert f"not enough disk space for the final model and a checkpoint in {str(out)!r}" in errors[0]
    assert "free, about" in errors[0] and "needed" in errors[0]
    assert list(disk.iterdir()) == []  # nothing written, not even the folder


class FillDiskAfterFirstSave(TrainerCallback):
    """After the first checkpoint, leave the disk almost full: the next save runs out of space mid-way."""

    def __init__(self, disk: Path) -> None:
        self.disk = disk

    def on_save(self, args, state, control, **kwargs):
        if not (self.disk / "filler").exists():
            room = free_bytes(self.disk) - 96 * 1024
            with open(self.disk / "filler", "wb") as handle:
                handle.write(b"\0" * max(room, 0))


def test_a_disk_that_fills_during_a_save_keeps_the_previous_checkpoint(small_disk) -> None:
    disk = small_disk("16m")
    out = disk / "run"
    args = make_args(out, save_strategy="steps", save_steps=2, max_steps=6)
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(24, seed=3))
    trainer.add_callback(FillDiskAfterFirstSave(disk))
    with pytest.raises(DiskFullError) as caught:
        trainer.train()
    said = str(caught.value)
    assert said.startswith(f"no space left on the device while writing {str(out / 'checkpoint-4')!r} (")
    assert "the unfinished save was removed; checkpoint-2 is intact" in said
    assert "iostream" not in said
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
    verify(out / "checkpoint-2", kind="trainer")  # the previous checkpoint is whole
    (disk / "filler").unlink()
    resumed = Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(24, seed=3))
    assert resumed.resolve_resume(True) == str(out / "checkpoint-2")
