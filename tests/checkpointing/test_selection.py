"""Which checkpoint a resume picks (checkpointing.selection): the Trainer's, the job's and the loops' one answer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer_ext.checkpointing import newest_complete, write_marker
from trainer_ext.checkpointing.selection import AUTO, newest_state, requested_checkpoint
from trainer_ext.errors import ConfigError


def _ours(folder: Path, when: int) -> Path:
    """A loop's committed ``save_state`` folder (its files and marker), committed at ``when`` (ns)."""
    folder.mkdir(parents=True)
    (folder / "state.json").write_text("{}")
    (folder / "random_states_0.pkl").write_bytes(b"0")
    marker = write_marker(folder, world_size=1, kind="loop")
    os.utime(marker, ns=(when, when))
    return folder


def _theirs(folder: Path, when: int) -> Path:
    """A folder as accelerate's ``save_state`` leaves it (file names only: selection reads no contents)."""
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl"):
        (folder / name).write_bytes(b"0")
        os.utime(folder / name, ns=(when, when))
    return folder


def test_the_loop_state_committed_last_is_picked(tmp_path: Path) -> None:
    _ours(tmp_path / "b", 2_000)
    newest = _ours(tmp_path / "a", 3_000)
    assert newest_state(tmp_path) == newest


def test_a_swap_cut_short_is_named_by_its_folder(tmp_path: Path) -> None:
    """A crash between the two renames leaves only ``.NAME.saving``: NAME is picked (its loader finds the copy)."""
    _ours(tmp_path / "older", 1_000)
    _ours(tmp_path / ".state.saving", 5_000)
    assert newest_state(tmp_path) == tmp_path / "state"


def test_accelerate_numbering_competes_by_number_then_by_time(tmp_path: Path) -> None:
    """Our newest folder (by commit time) and accelerate's highest ``checkpoint_<n>``: the higher number wins when
    both are numbered, else the later save."""
    _theirs(tmp_path / "checkpoint_0", 1_000)
    theirs = _theirs(tmp_path / "checkpoint_3", 2_000)
    _ours(tmp_path / "checkpoint_2", 9_000)
    assert newest_state(tmp_path) == theirs
    ours = _ours(tmp_path / "checkpoint_4", 10_000)
    assert newest_state(tmp_path) == ours
    only_time = tmp_path / "by_time"
    _theirs(only_time / "checkpoint_1", 2_000)
    unnumbered = _ours(only_time / "mine", 3_000)
    assert newest_state(only_time) == unnumbered


def test_no_state_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no complete checkpoint under .*call save_state"):
        newest_state(tmp_path)


def test_a_run_without_markers_resumes_as_transformers_would(tmp_path: Path) -> None:
    """No checkpoint has a marker (a plain transformers run): the newest finished one, as the Trainer resumes."""
    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    (tmp_path / "checkpoint-6").mkdir()  # died before trainer_state.json
    chosen, skipped = newest_complete(tmp_path, "trainer")
    assert chosen == tmp_path / "checkpoint-4", skipped
    assert skipped == ["checkpoint-6: no trainer_state.json (not a finished checkpoint)"]
    assert newest_complete(tmp_path, verify=False) == (tmp_path / "checkpoint-6", [])


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        ("--resume_from_checkpoint", r"^--resume_from_checkpoint '.*checkpoint-9': no such checkpoint directory"),
        (None, r"^Can't find a valid checkpoint at .*checkpoint-9: no such directory"),
    ],
)
def test_a_missing_path_is_refused_in_the_words_of_its_caller(tmp_path: Path, flag: str | None, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        requested_checkpoint(str(tmp_path / "checkpoint-9"), flag=flag)
    assert requested_checkpoint(str(tmp_path)) == str(tmp_path)
    assert requested_checkpoint(" LAST ") is True and requested_checkpoint("auto") == AUTO
    assert requested_checkpoint("no") is None
