"""A damaged or crafted ``COMPLETE`` marker never switches verification off; dead saves are rotated; one run per folder.

Each damage here was once accepted: a truncated, emptied or retyped marker (verification then had nothing to
check), a folder holding only a marker, a checkpoint folder that is a link, unmarked folders of killed saves kept
forever, and two runs in one output folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from tests.helpers.jobs import StopAt, make_args
from tests.helpers.ranks import child_env
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.checkpointing import COMPLETE, CheckpointError, verify
from trainer_ext.checkpointing.listing import rotate
from trainer_ext.checkpointing.marker import SAVING, check_marker, read_marker, seal
from trainer_ext.errors import ConfigError

pytestmark = pytest.mark.timeout(180)
DATA = lm_dataset(16, seed=3)
COMMON = dict(save_strategy="steps", save_steps=2, num_train_epochs=1)


def _trainer(out: Path, **overrides) -> Trainer:
    return Trainer(model=tiny_llama(0), args=make_args(out, **{**COMMON, **overrides}), train_dataset=DATA)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoint-2 and checkpoint-4 of a real run, committed (copied per test)."""
    out = tmp_path_factory.mktemp("saved")
    trainer = _trainer(out)
    trainer.add_callback(StopAt(4))
    trainer.train()
    return out


@pytest.fixture
def run_dir(saved: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    return out


def _damage_weights(folder: Path) -> None:
    """Same size, other bytes: only the checksum can tell (it would train to NaN if loaded)."""
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-64:] = b"\xff" * 64
    path.write_bytes(bytes(data))


MARKER_DAMAGE = {
    "truncated": lambda text: text[: len(text) // 2],
    "empty": lambda text: "",
    "a number": lambda text: "1",
    "a list": lambda text: "[1, 2]",
    "not UTF-8": lambda text: "\udcff",
    "no files": lambda text: json.dumps({"files": {}, "crc32": {}, "world_size": 1}),
    "edited, not resealed": lambda text: text.replace('"world_size": 1', '"world_size": 2'),
}


@pytest.mark.parametrize("damage", sorted(MARKER_DAMAGE))
def test_a_damaged_marker_is_not_complete_and_resume_falls_back(run_dir: Path, damage: str, caplog) -> None:
    newest = run_dir / "checkpoint-4"
    marker = newest / COMPLETE
    text = MARKER_DAMAGE[damage](marker.read_text())
    marker.write_bytes(text.encode("utf-8", "surrogateescape"))
    _damage_weights(newest)  # the case: with the marker ignored, these weights were loaded
    with pytest.raises(CheckpointError, match=f"{COMPLETE} is damaged"):
        verify(newest)
    with caplog.at_level("WARNING"):
        assert _trainer(run_dir).resolve_resume(True) == str(run_dir / "checkpoint-2")
    assert f"skipping checkpoint-4: {COMPLETE} is damaged" in caplog.text
    with pytest.raises(ConfigError, match=f"refusing to resume from .*{COMPLETE} is damaged"):
        _trainer(run_dir).resolve_resume(str(newest))


def test_the_marker_schema_names_what_is_wrong() -> None:
    good = {"trainer_ext_checkpoint": 1, "world_size": 1, "step": 2, "files": {"a": 3}, "crc32": {"a": 7}}
    assert check_marker(seal(good))["files"] == {"a": 3}
    cases = {
        "world_size is not a positive integer": {"world_size": "1"},
        "files has an entry that is not a name and a size": {"files": {"a": -3}},
        "crc32 does not cover exactly the listed files": {"crc32": {"a": 7, "b": 1}},
        "crc32 is not a table of checksums": {"crc32": {"a": 1 << 40}},
        "step is not a non-negative integer": {"step": True},
        "kind 'x' is unknown": {"kind": "x"},
    }
    for words, change in cases.items():
        with pytest.raises(CheckpointError, match=words):
            check_marker(seal({**good, **change}))
    with pytest.raises(CheckpointError, match="do not match its own checksum"):
        check_marker({**seal(good), "step": 3})


def test_a_folder_holding_only_a_marker_is_not_a_checkpoint(run_dir: Path, caplog) -> None:
    """The issue's case: ``mkdir checkpoint-6`` with a hand-written marker; and a sealed marker of nothing."""
    fake = run_dir / "checkpoint-6"
    fake.mkdir()
    (fake / COMPLETE).write_text('{"files":{},"crc32":{},"world_size":1}')
    with caplog.at_level("WARNING"):
        assert _trainer(run_dir).resolve_resume(True) == str(run_dir / "checkpoint-4")
    (fake / "notes.txt").write_text("x")
    crc = zlib.crc32(b"x")
    body = {"trainer_ext_checkpoint": 1, "world_size": 1, "files": {"notes.txt": 1}, "crc32": {"notes.txt": crc}}
    (fake / COMPLETE).write_text(json.dumps(seal(body)))
    assert read_marker(fake)["files"] == {"notes.txt": 1}  # a whole marker ...
    with pytest.raises(ConfigError, match="is missing trainer_state.json and the model's weights"):
        _trainer(run_dir).resolve_resume(str(fake))  # ... of a folder that is no Trainer checkpoint
    assert _trainer(run_dir).resolve_resume(True) == str(run_dir / "checkpoint-4")


def test_a_file_left_out_of_a_resealed_marker_is_refused_not_trusted(run_dir: Path, caplog) -> None:
    """A marker resealed by hand without ``optimizer.pt``: its bytes were then loaded unchecked (here another
    step's optimizer state, which loads fine). Every file of the folder must be listed."""
    newest = run_dir / "checkpoint-4"
    body = json.loads((newest / COMPLETE).read_text())
    del body["files"]["optimizer.pt"], body["crc32"]["optimizer.pt"]
    (newest / COMPLETE).write_text(json.dumps(seal(body)))
    shutil.copyfile(run_dir / "checkpoint-2" / "optimizer.pt", newest / "optimizer.pt")
    with pytest.raises(CheckpointError, match=f"optimizer.pt is not listed in {COMPLETE}"):
        verify(newest)
    with caplog.at_level("WARNING"):
        assert _trainer(run_dir).resolve_resume(True) == str(run_dir / "checkpoint-2")
    assert f"skipping checkpoint-4: optimizer.pt is not listed in {COMPLETE}" in caplog.text
    with pytest.raises(ConfigError, match="refusing to resume from .*optimizer.pt is not listed"):
        _trainer(run_dir).resolve_resume(str(newest))


def test_a_checkpoint_folder_that_is_a_link_is_refused_and_never_rotated(run_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (run_dir / "checkpoint-4").rename(elsewhere)
    (run_dir / "checkpoint-4").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ConfigError, match="checkpoint-4 is itself a symbolic link"):
        _trainer(run_dir).resolve_resume(str(run_dir / "checkpoint-4"))
    assert _trainer(run_dir).resolve_resume(True) == str(run_dir / "checkpoint-2")
    rotate(run_dir, 1)
    assert (elsewhere / COMPLETE).is_file() and (run_dir / "checkpoint-4").is_symlink()


def test_rotation_removes_dead_saves_of_ours_but_not_foreign_checkpoints(run_dir: Path) -> None:
    """Killed after trainer_state.json: the in-progress tag (or a damaged marker) says the folder is ours."""
    for step, how in ((1, "tag"), (3, "damaged marker")):
        dead = run_dir / f"checkpoint-{step}"
        shutil.copytree(run_dir / "checkpoint-2", dead)
        if how == "tag":
            (dead / COMPLETE).unlink()
            (dead / SAVING).touch()
        else:
            (dead / COMPLETE).write_text("{")
    foreign = run_dir / "checkpoint-0"  # written by plain transformers: trainer_state.json, no marker, no tag
    shutil.copytree(run_dir / "checkpoint-2", foreign)
    (foreign / COMPLETE).unlink()
    removed = rotate(run_dir, 2)
    assert [p.name for p in removed] == ["checkpoint-1", "checkpoint-3"]
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-0", "checkpoint-2", "checkpoint-4"]


def test_a_finished_save_leaves_no_tag_and_a_killed_one_is_rotated_by_the_next_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    trainer = _trainer(out, save_total_limit=2)
    trainer.add_callback(StopAt(6))
    trainer.train()
    assert not any(out.glob(f"checkpoint-*/{SAVING}"))
    # a save killed after trainer_state.json, before its marker: as the next save found it
    dead = out / "checkpoint-1"
    dead.mkdir()
    (dead / SAVING).touch()
    (dead / "trainer_state.json").write_text("{}")
    (dead / "model.safetensors").write_bytes(b"partial")
    resumed = _trainer(out, save_total_limit=2)
    resumed.add_callback(StopAt(8))
    resumed.train(resume_from_checkpoint=True)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]


HOLD = """
import sys, time
from trainer_ext.job import run_lock
run_lock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(60)
"""


def test_two_runs_in_one_output_folder_are_refused_naming_the_holder(tmp_path: Path) -> None:
    from trainer_ext.job import run_lock
    from trainer_ext.job.run import train

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"in use by another run \(PID {holder.pid} on .*pick another"):
            run_lock.acquire(out)
        job = {"output_dir": str(out), "max_steps": 2, "report_to": "none", "use_cpu": True}
        with pytest.raises(ConfigError, match=f"PID {holder.pid}"):
            train(job)
        assert not (out / "trainer_ext_run.json").exists()
    finally:
        holder.kill()
        holder.wait()
    run_lock.acquire(out)  # the holder died: the system released its lock, the file stays harmless
    run_lock.release(out)
