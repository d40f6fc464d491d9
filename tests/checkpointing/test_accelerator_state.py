"""``Accelerator.save_state``/``load_state``: a failed save keeps the previous checkpoint, loading verifies it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Accelerator
from trainer_ext.checkpointing import COMPLETE, commit
from trainer_ext.errors import ConfigError

pytestmark = pytest.mark.timeout(120)
BATCH = {k: torch.tensor(v) for k, v in lm_dataset(2, seed=1)[:2].items()}


def _prepared(project: Path) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer]:
    accelerator = Accelerator(cpu=True, project_dir=project, seed=0)
    model = tiny_llama(0)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    accelerator.backward(model(**BATCH).loss)
    optimizer.step()
    optimizer.zero_grad()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_weights(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_full_disk_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path, monkeypatch) -> None:
    """The default folder (project_dir/checkpoints/checkpoint) is rewritten by every save: never half of it."""
    accelerator, model, optimizer = _prepared(tmp_path)
    _step(accelerator, model, optimizer)
    first = Path(accelerator.save_state())
    saved = _weights(model)
    _step(accelerator, model, optimizer)
    real = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("random_states_0.pkl"):  # late in the save: the weights and optimizer are already written
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        accelerator.save_state()
    monkeypatch.undo()
    accelerator.load_state(first)
    _assert_weights(model, saved)
    _step(accelerator, model, optimizer)
    accelerator.save_state()  # the leftover of the failed save is cleared, the folder replaced
    assert sorted(os.listdir(first.parent)) == [first.name]


def test_a_crash_between_the_two_renames_loads_the_complete_copy(tmp_path: Path, monkeypatch, caplog) -> None:
    accelerator, model, optimizer = _prepared(tmp_path)
    first = Path(accelerator.save_state())
    _step(accelerator, model, optimizer)
    newer = _weights(model)
    real, calls = os.replace, []

    def crash_on_second(src, dst):
        calls.extend([dst] if Path(src).is_dir() else [])  # folder renames only (the marker is renamed too)
        if len(calls) == 2:  # the old folder is moved aside, the new one not yet in place
            raise OSError(errno.EIO, "killed (simulated)")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(OSError, match="killed"):
        accelerator.save_state()
    monkeypatch.undo()
    assert not first.exists()
    _step(accelerator, model, optimizer)
    with caplog.at_level("WARNING"):
        accelerator.load_state(first)
    assert "loading the complete copy" in caplog.text
    _assert_weights(model, newer)
    _step(accelerator, model, optimizer)
    caplog.clear()
    with caplog.at_level("WARNING"):
        accelerator.load_state()  # no folder: the newest complete checkpoint, found through the hidden copy
    assert "loading the complete copy" in caplog.text
    _assert_weights(model, newer)
    accelerator.save_state()  # finishes the interrupted swap, then saves
    assert sorted(os.listdir(first.parent)) == [first.name]


def test_load_state_verifies_the_checksums(tmp_path: Path) -> None:
    accelerator, model, optimizer = _prepared(tmp_path)
    folder = Path(accelerator.save_state(tmp_path / "state"))
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(255 - b for b in data[-64:])  # same size, the header intact: only the checksum tells
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"model\.safetensors does not match its checksum"):
        accelerator.load_state(folder)


def test_save_state_refuses_a_folder_holding_other_files(tmp_path: Path) -> None:
    accelerator, _, _ = _prepared(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"holds files that are not part of a complete checkpoint \(notes\.txt\)"):
        accelerator.save_state(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"], "nothing written beside it"


def test_the_files_are_on_disk_before_the_marker(tmp_path: Path, monkeypatch) -> None:
    """Every file and folder, at any depth (full paths compared), is fsynced before COMPLETE is written."""
    accelerator, _, _ = _prepared(tmp_path)
    synced: set[str] = set()
    real_fsync = os.fsync

    def record(fd):
        synced.add(os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def check_then_write(directory, **kwargs):
        unsynced = {str(p.resolve()) for p in Path(directory).rglob("*")} - synced
        assert not unsynced, f"not fsynced before the marker: {unsynced}"
        return real_write(directory, **kwargs)

    real_write = commit.write_marker
    monkeypatch.setattr(os, "fsync", record)
    monkeypatch.setattr(commit, "write_marker", check_then_write)
    folder = Path(accelerator.save_state(tmp_path / "state"))
    assert (folder / COMPLETE).is_file()
