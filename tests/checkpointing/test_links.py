"""The link rule: a job never writes, truncates or deletes through a symbolic link inside its output_dir.

Each case plants a link to a victim outside output_dir where the job writes (a checkpoint folder, a file of a
checkpoint, the lock, the run file and its temporary copy, the final model's files, the results) and checks that the
victim is byte-identical afterwards and that the job refused with one line naming the link, or wrote safely (the
link replaced, not followed). Each case once wrote through its link.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import TrainerCallback

from tests.helpers.jobs import make_args
from tests.helpers.ranks import child_env, run_ranks
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.checkpointing import COMPLETE, verify
from trainer_ext.checkpointing.marker import SAVING
from trainer_ext.errors import ConfigError
from trainer_ext.job.run import train

pytestmark = pytest.mark.timeout(240)
DATA = lm_dataset(8, seed=3)
CHECKPOINT_FILES = (
    "model.safetensors",
    "config.json",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
    "training_args.bin",
    COMPLETE,
    SAVING,
)


def _fingerprint(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed) with a digest of its bytes: the victim as it was."""
    found = {".": "dir" if root.is_dir() else hashlib.sha256(root.read_bytes()).hexdigest()}
    if root.is_dir():
        for path in sorted(root.rglob("*")):
            kind = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
            found[str(path.relative_to(root))] = kind
    return found


def _victim(tmp_path: Path, folder: bool) -> tuple[Path, dict[str, str]]:
    """A user's file (or folder of files) outside output_dir, and how it looks now."""
    victim = tmp_path / "victim"
    if folder:
        victim.mkdir()
        for name in ("model.safetensors", "optimizer.pt", "notes.txt"):
            (victim / name).write_bytes(f"the user's own {name}\n".encode())
    else:
        victim.write_bytes(b"the user's own file\n")
    return victim, _fingerprint(victim)


def _one_line(error: BaseException, link: Path) -> None:
    text = str(error)
    assert "\n" not in text and str(link) in text and "symbolic link" in text, text


def _trainer(out: Path, callbacks=(), **overrides) -> Trainer:
    settings = dict(save_strategy="steps", save_steps=2, max_steps=2, **overrides)
    return Trainer(model=tiny_llama(0), args=make_args(out, **settings), train_dataset=DATA, callbacks=list(callbacks))


# ------------------------------------------------------------------------------ the Trainer, at each save


def test_a_checkpoint_folder_that_is_a_link_is_refused_at_the_save(tmp_path: Path) -> None:
    victim, before = _victim(tmp_path, folder=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-2").symlink_to(victim, target_is_directory=True)
    with pytest.raises(ConfigError) as refused:
        _trainer(out).train()
    _one_line(refused.value, out / "checkpoint-2")
    assert _fingerprint(victim) == before


@pytest.mark.distributed
@pytest.mark.parametrize(("where", "link"), [("checkpoint", "checkpoint-2"), ("export", "config.json")])
def test_on_two_ranks_every_rank_refuses_and_none_waits(tmp_path: Path, where: str, link: str) -> None:
    """A checkpoint-N link at the save (DDP); a link made during the run where FSDP2's gathered model goes."""
    victim, before = _victim(tmp_path, folder=where == "checkpoint")
    run_ranks("tests.checkpointing.link_job", 2, str(tmp_path), str(victim), where, timeout=200)
    errors = [json.loads((tmp_path / f"rank{rank}.json").read_text())["error"] for rank in (0, 1)]
    _one_line(ConfigError(errors[0]), tmp_path / "run" / link)
    assert errors[1] is not None and str(tmp_path / "run" / link) in errors[1]
    assert _fingerprint(victim) == before


class LinkAt(TrainerCallback):
    """Plants a link at ``path`` (to ``target``) at the end of step ``step``: a link made while the job runs."""

    def __init__(self, step: int, path: Path, target: Path) -> None:
        self.step, self.path, self.target = step, path, target

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.symlink_to(self.target, target_is_directory=self.target.is_dir())


def test_a_link_made_during_the_run_is_refused_at_the_save(tmp_path: Path) -> None:
    victim, before = _victim(tmp_path, folder=True)
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as refused:
        _trainer(out, callbacks=[LinkAt(1, out / "checkpoint-2", victim)]).train()
    _one_line(refused.value, out / "checkpoint-2")
    assert _fingerprint(victim) == before


@pytest.mark.parametrize("name", CHECKPOINT_FILES)
@pytest.mark.parametrize("state", ["dead", "complete"])
def test_a_link_inside_a_checkpoint_folder_that_is_saved_again_is_refused(
    tmp_path: Path, name: str, state: str
) -> None:
    """A dead save (no marker, its tag) or a complete checkpoint of an earlier run, about to be written again."""
    victim, before = _victim(tmp_path, folder=False)
    out = tmp_path / "out"
    folder = out / "checkpoint-2"
    folder.mkdir(parents=True)
    if state == "dead":
        (folder / SAVING).touch()
        (folder / "trainer_state.json").write_text("{}")
    else:
        _trainer(tmp_path / "earlier").train()
        shutil.rmtree(folder)
        shutil.copytree(tmp_path / "earlier" / "checkpoint-2", folder)
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(victim)
    with pytest.raises(ConfigError) as refused:
        _trainer(out).train()
    _one_line(refused.value, folder / name)
    assert _fingerprint(victim) == before


@pytest.mark.parametrize("state", ["dead", "complete"])
def test_a_checkpoint_folder_is_cleared_before_it_is_saved_again(tmp_path: Path, state: str) -> None:
    """A killed save (or an earlier run's checkpoint) left checkpoint-2 with a folder where trainer_state.json goes
    and a stray file: the next save at step 2 starts from an empty folder (it raised IsADirectoryError) and commits
    only what it wrote."""
    out = tmp_path / "out"
    dead = out / "checkpoint-2"
    if state == "complete":
        _trainer(tmp_path / "earlier").train()
        shutil.copytree(tmp_path / "earlier" / "checkpoint-2", dead)
        (dead / "trainer_state.json").unlink()
    (dead / "trainer_state.json").mkdir(parents=True)
    (dead / SAVING).touch()
    (dead / "pytorch_model.bin").write_bytes(b"stale weights of a save that died")
    _trainer(out).train()
    assert (dead / "trainer_state.json").is_file() and not (dead / "pytorch_model.bin").exists()
    verify(dead, kind="trainer")


@pytest.mark.parametrize(
    ("name", "save"),
    [
        ("config.json", "save_model"),
        ("training_args.bin", "save_model"),
        ("all_results.json", "save_metrics"),
        ("trainer_state.json", "save_state"),
    ],
)
def test_the_trainers_own_final_saves_refuse_a_link_where_they_write(tmp_path: Path, name: str, save: str) -> None:
    victim, before = _victim(tmp_path, folder=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(victim)
    trainer = _trainer(out)
    with pytest.raises(ConfigError) as refused:
        trainer.save_metrics("train", {"loss": 1.0}) if save == "save_metrics" else getattr(trainer, save)()
    _one_line(refused.value, out / name)
    assert _fingerprint(victim) == before


# ------------------------------------------------------------------------------ train(args): every path it writes


def _job(out: Path, **overrides) -> dict:
    """A job of a few seconds that writes every kind of file: a checkpoint, the final model, results, a report."""
    values = dict(
        output_dir=str(out),
        max_steps=2,
        save_strategy="steps",
        save_steps=2,
        max_train_samples=32,
        max_eval_samples=16,
        per_device_train_batch_size=16,
        report_to="none",
        disable_tqdm=True,
    )
    return {**values, **overrides}


# (where, in output_dir; whether the victim is a folder)
WRITTEN = [
    (".trainer_ext.lock", False),
    ("trainer_ext_run.json", False),
    (".trainer_ext_run.json.tmp", False),
    ("checkpoint-2", True),
    ("checkpoint-3", False),  # a link named like a checkpoint, to a file
    ("checkpoint-2/optimizer.pt", False),
    ("checkpoint-2/trainer_state.json", False),
    ("model.safetensors", False),
    ("config.json", False),
    ("tokenizer.json", False),
    ("trainer_state.json", False),
    ("all_results.json", False),
    ("eval_results.json", False),
    ("trainer_ext_events.jsonl", False),
    ("report", True),
    ("report/report.html", False),
]


@pytest.mark.parametrize(("where", "folder"), WRITTEN, ids=[w for w, _ in WRITTEN])
def test_a_link_where_the_job_writes_is_refused_before_training(tmp_path: Path, where: str, folder: bool) -> None:
    victim, before = _victim(tmp_path, folder)
    out = tmp_path / "out"
    link = out / where
    link.parent.mkdir(parents=True)
    if link.parent.name.startswith("checkpoint-"):
        (link.parent / SAVING).touch()  # a save that died
    link.symlink_to(victim, target_is_directory=folder)
    entries = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(ConfigError) as refused:
        train(_job(out))
    _one_line(refused.value, link)
    assert _fingerprint(victim) == before
    assert sorted(p.name for p in out.rglob("*")) == entries, "refused before anything was written"


@pytest.mark.parametrize(
    "name", ["model.safetensors", "config.json", "tokenizer.json", "model-00001-of-00002.safetensors"]
)
def test_a_link_made_during_the_run_where_the_final_model_goes_is_replaced_not_followed(
    tmp_path: Path, name: str
) -> None:
    victim, before = _victim(tmp_path, folder=False)
    out = tmp_path / "out"
    train(_job(out, save_strategy="no"), callbacks=[LinkAt(1, out / name, victim)])
    assert _fingerprint(victim) == before
    assert not (out / name).is_symlink()
    if name.startswith("model-"):
        assert not (out / name).exists(), "an earlier save's other weights are removed (the link itself)"
    assert not list(out.glob(".trainer_ext_saving_model.*")), "the temporary folder is gone"


def test_a_link_made_during_the_run_where_the_results_go_is_refused(tmp_path: Path) -> None:
    victim, before = _victim(tmp_path, folder=False)
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as refused:
        train(_job(out, save_strategy="no"), callbacks=[LinkAt(1, out / "train_results.json", victim)])
    _one_line(refused.value, out / "train_results.json")
    assert _fingerprint(victim) == before


def test_the_lock_is_never_opened_through_a_link(tmp_path: Path) -> None:
    """The lock file as a link (also a dangling one): it was opened through it and the target truncated."""
    from trainer_ext.job import run_lock

    victim, before = _victim(tmp_path, folder=False)
    for target in (victim, tmp_path / "nowhere"):
        out = tmp_path / f"out-{target.name}"
        out.mkdir()
        (out / run_lock.LOCK_FILE).symlink_to(target)
        with pytest.raises(ConfigError) as refused:
            run_lock.acquire(out)
        _one_line(refused.value, out / run_lock.LOCK_FILE)
    assert _fingerprint(victim) == before and not (tmp_path / "nowhere").exists()


# ------------------------------------------------------------------------------ --overwrite_output_dir


def test_overwrite_removes_a_checkpoint_link_itself_and_keeps_its_target(tmp_path: Path) -> None:
    """It crashed (``Cannot call rmtree on a symbolic link``) after deleting the other checkpoints."""
    victim, before = _victim(tmp_path, folder=True)
    out = tmp_path / "out"
    train(_job(out))
    (out / "checkpoint-4").symlink_to(victim, target_is_directory=True)
    (out / "checkpoint-6").symlink_to(tmp_path / "nowhere", target_is_directory=True)
    (out / "report").rename(tmp_path / "report")
    (out / "report").symlink_to(tmp_path / "report", target_is_directory=True)
    report = _fingerprint(tmp_path / "report")
    train(_job(out, overwrite_output_dir=True))
    assert _fingerprint(victim) == before and _fingerprint(tmp_path / "report") == report
    assert not os.path.lexists(out / "checkpoint-4") and not os.path.lexists(out / "checkpoint-6")
    assert (out / "checkpoint-2").is_dir() and not (out / "report").is_symlink()


def test_overwrite_refuses_a_lock_link_before_deleting_anything(tmp_path: Path) -> None:
    victim, before = _victim(tmp_path, folder=False)
    out = tmp_path / "out"
    train(_job(out))
    (out / ".trainer_ext.lock").unlink()
    (out / ".trainer_ext.lock").symlink_to(victim)
    with pytest.raises(ConfigError) as refused:
        train(_job(out, overwrite_output_dir=True))
    _one_line(refused.value, out / ".trainer_ext.lock")
    assert _fingerprint(victim) == before and (out / "checkpoint-2" / COMPLETE).is_file()


# ------------------------------------------------------------------------------ a path the file system refuses


def _cli_train(out: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``trainer-ext train`` into ``out`` in a child process that must exit 2; its stderr's error lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_ext", "train", "--output_dir", str(out), "--max_steps", "1"],
        capture_output=True,
        text=True,
        timeout=200,
        env={**child_env(), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    return proc, [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_an_output_dir_too_long_for_the_file_system_is_one_line_exit_2(tmp_path: Path) -> None:
    out = tmp_path / ("a" * 300)
    with pytest.raises(ConfigError, match="too long for the file system"):
        train(_job(out))
    proc, errors = _cli_train(out)
    assert len(errors) == 1 and "too long for the file system" in errors[0] and "Traceback" not in proc.stderr


def test_the_cli_refuses_a_link_with_one_line_and_exit_2(tmp_path: Path) -> None:
    victim, before = _victim(tmp_path, folder=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-2").symlink_to(victim, target_is_directory=True)
    proc, errors = _cli_train(out)
    assert len(errors) == 1 and str(out / "checkpoint-2") in errors[0] and "Traceback" not in proc.stderr
    assert _fingerprint(victim) == before
