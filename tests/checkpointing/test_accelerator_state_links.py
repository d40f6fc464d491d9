"""The link rule for ``Accelerator.save_state``: a symbolic link at any folder or file it writes, renames or
deletes is refused in one line before anything is written, and the link's target stays byte-identical.

The matrix: the folder itself (explicit, the default ``checkpoints/checkpoint``, an automatic ``checkpoint_<n>``),
the staging and set-aside names beside it, and a file or folder inside a checkpoint being replaced; a link among
the folders ``total_limit`` rotates away is removed itself, never its target.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainer_ext import Accelerator, ProjectConfiguration
from trainer_ext.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


def _accelerator(project: Path, **naming) -> Accelerator:
    config = ProjectConfiguration(project_dir=str(project), **naming)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Linear(4, 2)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return accelerator


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A complete checkpoint outside the project (what a careless link points to), and a file beside it."""
    folder = Path(_accelerator(tmp_path / "elsewhere").save_state(tmp_path / "victim"))
    (folder.parent / "victim.txt").write_text("the user's own file")
    return folder


Case = Callable[[Path, Path], tuple[Accelerator, Path | None]]  # (project, victim) -> accelerator, output_dir


def _explicit_folder(project: Path, victim: Path):
    (project / "out").parent.mkdir(parents=True, exist_ok=True)
    (project / "out").symlink_to(victim)
    return _accelerator(project), project / "out"


def _explicit_dangling(project: Path, victim: Path):
    project.mkdir(parents=True, exist_ok=True)
    (project / "out").symlink_to(victim.parent / "not_there_yet")
    return _accelerator(project), project / "out"


def _default_folder(project: Path, victim: Path):
    (project / "checkpoints").mkdir(parents=True)
    (project / "checkpoints" / "checkpoint").symlink_to(victim)
    return _accelerator(project), None


def _automatic_folder_rotated(project: Path, victim: Path):
    (project / "checkpoints").mkdir(parents=True)
    (project / "checkpoints" / "checkpoint_0").symlink_to(victim)
    return _accelerator(project, automatic_checkpoint_naming=True, total_limit=1), None


def _staging(project: Path, victim: Path):
    (project / "checkpoints").mkdir(parents=True)
    (project / "checkpoints" / ".checkpoint.saving").symlink_to(victim)
    return _accelerator(project), None


def _set_aside(project: Path, victim: Path):
    (project / "checkpoints").mkdir(parents=True)
    (project / "checkpoints" / ".checkpoint.replaced").symlink_to(victim)
    return _accelerator(project), None


def _inside(name: str, target: Callable[[Path], Path]) -> Case:
    """A complete checkpoint being replaced, whose ``name`` is a link (to the same bytes, so it still verifies)."""

    def make(project: Path, victim: Path):
        accelerator = _accelerator(project)
        folder = Path(accelerator.save_state())
        if (folder / name).exists():
            (folder / name).unlink()
        (folder / name).symlink_to(target(victim))
        return accelerator, None

    return make


CASES: dict[str, Case] = {
    "explicit output_dir links to a folder": _explicit_folder,
    "explicit output_dir is a dangling link": _explicit_dangling,
    "checkpoints/checkpoint links to a folder": _default_folder,
    "checkpoint_0 (saved into, and rotated by total_limit) links to a folder": _automatic_folder_rotated,
    "the staging folder .checkpoint.saving is a link": _staging,
    "the set-aside folder .checkpoint.replaced is a link": _set_aside,
    "model.safetensors inside the replaced folder": _inside("model.safetensors", lambda v: v / "model.safetensors"),
    "COMPLETE inside the replaced folder": _inside("COMPLETE", lambda v: v / "COMPLETE"),
    "optimizer.bin inside the replaced folder": _inside("optimizer.bin", lambda v: v / "optimizer.bin"),
    "a folder link inside the replaced folder": _inside("extra", lambda v: v),
    "a file link to a file outside": _inside("notes.txt", lambda v: v.parent / "victim.txt"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_link_is_refused_in_one_line_and_its_target_is_untouched(tmp_path: Path, victim: Path, case: str) -> None:
    before, beside = _contents(victim), (victim.parent / "victim.txt").read_bytes()
    accelerator, output_dir = CASES[case](tmp_path / "project", victim)
    with pytest.raises(ConfigError, match="symbolic link") as refused:
        accelerator.save_state(output_dir)
    assert "\n" not in str(refused.value)
    assert _contents(victim) == before
    assert (victim.parent / "victim.txt").read_bytes() == beside
    assert not (victim.parent / "not_there_yet").exists()


def test_a_link_among_older_checkpoints_is_removed_itself_by_the_rotation(tmp_path: Path, victim: Path) -> None:
    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "checkpoints" / "checkpoint_0").symlink_to(victim)
    before = _contents(victim)
    config = ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=1, iteration=1
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Linear(4, 2)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert Path(accelerator.save_state()).name == "checkpoint_1"
    assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_1"]
    assert _contents(victim) == before
