"""Atomic checkpoints, newest-complete resume, fallback on corrupted files, safe rotation, preemption (1 rank)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from tests.helpers.jobs import StopAt, make_args, weights
from tests.helpers.ranks import child_env
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.checkpointing import COMPLETE, Preempted, newest_complete
from trainer_ext.checkpointing.disk_space import DiskFullError
from trainer_ext.checkpointing.marker import seal
from trainer_ext.errors import ConfigError

pytestmark = pytest.mark.timeout(120)
DATA = lm_dataset(24, seed=3)
# 12 steps of batch 2; the job's extras on (a plain Trainer has them off): preemption saves, the final model
COMMON = dict(save_strategy="steps", save_steps=2, num_train_epochs=1, save_on_preemption=True, save_final_model=True)


def _trainer(out: Path, callbacks=(), **overrides) -> Trainer:
    args = make_args(out, **{**COMMON, **overrides})
    return Trainer(model=tiny_llama(0), args=args, train_dataset=DATA, callbacks=list(callbacks))


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    trainer = _trainer(tmp_path_factory.mktemp("full"))
    trainer.train()
    return weights(trainer)


def test_every_checkpoint_is_committed_last(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    _trainer(tmp_path, callbacks=[StopAt(4)]).train()
    assert signal.getsignal(signal.SIGTERM) == before, "the preemption handlers are restored after training"
    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        body = json.loads((folder / COMPLETE).read_text())
        assert body["world_size"] == 1 and body["step"] == step
        assert "model.safetensors" in body["files"] and "optimizer.pt" in body["files"]
        newest_file = max(p.stat().st_mtime_ns for p in folder.iterdir() if p.name != COMPLETE)
        assert (folder / COMPLETE).stat().st_mtime_ns >= newest_file


def test_auto_resume_skips_a_partial_checkpoint_and_matches_the_full_run(
    tmp_path: Path, full_run: dict, caplog
) -> None:
    _trainer(tmp_path, callbacks=[StopAt(6)]).train()
    (tmp_path / "checkpoint-6" / COMPLETE).unlink()  # as if killed while writing checkpoint-6
    resumed = _trainer(tmp_path)
    with caplog.at_level("WARNING"):
        resumed.train(resume_from_checkpoint="auto")
    assert "checkpoint-6: no COMPLETE marker" in caplog.text and "checkpoint-4" in caplog.text
    _assert_equal(weights(resumed), full_run)


@pytest.mark.parametrize("damage", ["truncate_weights", "corrupt_optimizer", "truncate_rng"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage: str, caplog) -> None:
    _trainer(tmp_path, callbacks=[StopAt(4)]).train()
    folder = tmp_path / "checkpoint-4"
    name = {"truncate_weights": "model.safetensors", "corrupt_optimizer": "optimizer.pt"}.get(damage, "rng_state.pth")
    data = (folder / name).read_bytes()
    if damage.startswith("truncate"):
        (folder / name).write_bytes(data[: len(data) // 2])
    else:  # same size, garbage over the pickled structure: only loading it can tell
        (folder / name).write_bytes(b"\0" * 64 + data[64:])
    chosen, skipped = newest_complete(tmp_path)
    assert chosen == tmp_path / "checkpoint-2"
    assert len(skipped) == 1 and skipped[0].startswith(f"checkpoint-4: {name}")
    with pytest.raises(ConfigError, match="refusing to resume"):
        _trainer(tmp_path).resolve_resume(str(folder))


def test_a_pickled_object_in_a_checkpoint_is_refused(tmp_path: Path) -> None:
    _trainer(tmp_path, callbacks=[StopAt(2)]).train()
    folder = tmp_path / "checkpoint-2"
    torch.save({"evil": os.system}, folder / "scheduler.pt")  # would run code with weights_only=False
    (folder / COMPLETE).unlink()  # as a checkpoint from elsewhere: no marker, the files alone decide
    with pytest.raises(ConfigError, match=r"scheduler\.pt cannot be loaded safely \(weights_only=True\)"):
        _trainer(tmp_path).resolve_resume(str(folder))


def test_true_without_a_complete_checkpoint_explains(tmp_path: Path) -> None:
    (tmp_path / "checkpoint-3").mkdir(parents=True)
    trainer = _trainer(tmp_path)
    with pytest.raises(ConfigError, match="no complete checkpoint.*checkpoint-3: no trainer_state.json"):
        trainer.resolve_resume(True)
    assert trainer.resolve_resume("auto") is None


def test_another_model_or_world_size_is_refused(tmp_path: Path) -> None:
    _trainer(tmp_path, callbacks=[StopAt(2)]).train()
    folder = tmp_path / "checkpoint-2"
    other = Trainer(
        model=torch.nn.Sequential(torch.nn.Linear(3, 3)), args=make_args(tmp_path, **COMMON), train_dataset=DATA
    )
    with pytest.raises(ConfigError, match="holds another model"):
        other.resolve_resume(str(folder))
    body = json.loads((folder / COMPLETE).read_text())
    # 4 processes with 4x this run's global batch: the data position cannot carry over
    (folder / COMPLETE).write_text(
        json.dumps(seal({**body, "world_size": 4, "global_batch_size": 4 * body["global_batch_size"]}))
    )
    with pytest.raises(ConfigError, match="saved by 4 processes, this run has 1.*same global batch"):
        _trainer(tmp_path).resolve_resume(str(folder))
    # the same global batch over 4 processes (accumulation here makes up for them): it resumes
    (folder / COMPLETE).write_text(json.dumps(seal({**body, "world_size": 4})))
    assert _trainer(tmp_path).resolve_resume(str(folder)) == str(folder)


def test_rotation_keeps_the_limit_and_only_complete_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "checkpoint-1").mkdir(parents=True)  # a partial leftover of an earlier crash
    _trainer(tmp_path, save_total_limit=2, callbacks=[StopAt(8)]).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]


def test_rotation_never_deletes_checkpoints_written_without_trainer_ext(tmp_path: Path) -> None:
    """A finished checkpoint without our marker (e.g. from plain transformers) and the best one are kept."""
    from trainer_ext.checkpointing.listing import rotate
    from trainer_ext.checkpointing.marker import write_marker

    for step in (100, 200, 300, 400):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text("{}")
    write_marker(tmp_path / "checkpoint-400", world_size=1)
    (tmp_path / "checkpoint-50").mkdir()  # a save that died before writing anything
    deleted = rotate(tmp_path, 1, best=tmp_path / "checkpoint-200")
    assert [p.name for p in deleted] == ["checkpoint-50"]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-100",
        "checkpoint-200",
        "checkpoint-300",
        "checkpoint-400",
    ]


class KillSelf(TrainerCallback):
    """Send ``sig`` to this process during step ``step`` (before its end), as a scheduler would."""

    def __init__(self, step: int, sig: int) -> None:
        self.step, self.sig = step, sig

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_saves_at_the_next_step_and_exits_75(tmp_path: Path, sig: int, full_run: dict) -> None:
    before = signal.getsignal(signal.SIGTERM)
    trainer = _trainer(tmp_path, callbacks=[KillSelf(5, sig)])
    try:
        with pytest.raises(Preempted) as stopped:
            trainer.train()
    finally:  # after a preemption the handlers stay, so a second signal cannot kill the exiting process
        for caught in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(caught, before if caught == signal.SIGTERM else signal.SIG_DFL)
    assert stopped.value.code == 75
    assert (tmp_path / "checkpoint-5" / COMPLETE).is_file()
    assert not (tmp_path / "model.safetensors").exists(), "a preempted run must not look like a finished one"
    assert not (tmp_path / "checkpoint-6").exists()
    resumed = _trainer(tmp_path)
    resumed.train(resume_from_checkpoint="auto")
    _assert_equal(weights(resumed), full_run)


def test_a_full_disk_during_a_save_loses_nothing_already_saved(tmp_path: Path, full_run: dict, monkeypatch) -> None:
    """ENOSPC while writing checkpoint-4: checkpoint-2 stays complete and intact, auto resume goes back to it."""
    import errno

    import transformers

    real = transformers.Trainer._save_optimizer_and_scheduler

    def fail_on_step_4(self, output_dir):
        if output_dir.endswith("checkpoint-4"):
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return real(self, output_dir)

    monkeypatch.setattr(transformers.Trainer, "_save_optimizer_and_scheduler", fail_on_step_4)
    with pytest.raises(DiskFullError, match="while writing .*checkpoint-4.* removed; checkpoint-2 is intact"):
        _trainer(tmp_path).train()
    monkeypatch.undo()
    assert (tmp_path / "checkpoint-2" / COMPLETE).exists()
    assert not (tmp_path / "checkpoint-4").exists()  # the unfinished save is gone (a real full disk: test_disk_full)
    newest, skipped = newest_complete(str(tmp_path))
    assert newest.name == "checkpoint-2" and not skipped
    resumed = _trainer(tmp_path)
    resumed.train(resume_from_checkpoint="auto")
    _assert_equal(weights(resumed), full_run)


def test_an_output_dir_that_cannot_be_written_is_refused_up_front(tmp_path: Path, monkeypatch, capsys) -> None:
    """`trainer-ext train` probes the output directory before training (exit 2, a clear message)."""
    import tempfile

    from trainer_ext.cli.main import main

    out = tmp_path / "ro"
    out.mkdir()
    real = tempfile.NamedTemporaryFile

    def refuse(*args, **kwargs):
        if str(kwargs.get("dir", "")).startswith(str(out)):
            raise PermissionError(13, "Permission denied", str(out))
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    code = main(["train", "--output_dir", str(out), "--max_steps", "1", "--max_train_samples", "64"])
    assert code == 2
    assert "cannot write" in capsys.readouterr().err
    assert not any(out.iterdir())


_WORKERS_JOB = """
import os, signal
from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from transformers import TrainerCallback
from trainer_ext import Trainer

class SignalTheGroup(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.killpg(os.getpgid(0), signal.SIGTERM)  # what a scheduler does: the workers get it too

# one worker, one batch in flight, agreement every 4 steps: steps 2-4 need batches the worker makes after
# the signal, so a worker that died on it would fail the run before the save
args = make_args(
    {out!r}, save_strategy="steps", save_steps=100, max_steps=12, dataloader_num_workers=1,
    dataloader_prefetch_factor=1, preemption_check_steps=4, save_on_preemption=True,
)
Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(48), callbacks=[SignalTheGroup()]).train()
"""


@pytest.mark.slow
def test_preemption_with_data_loader_workers_saves_before_they_go(tmp_path: Path) -> None:
    """SIGTERM to the whole process group: the worker ignores it, the run saves checkpoint-4 and exits 75."""
    import subprocess
    import sys

    code = _WORKERS_JOB.format(out=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=110,
        start_new_session=True,
    )
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert (tmp_path / "checkpoint-4" / COMPLETE).is_file()


def test_signal_handlers_are_restored_when_training_fails(tmp_path: Path) -> None:
    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise RuntimeError("boom")

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, callbacks=[Boom()]).train()
    assert signal.getsignal(signal.SIGTERM) == before
