"""``trainer-ext checkpoint verify|seal`` on real Trainer checkpoints (issue 37, item 9).

A checkpoint re-sharded by hand (transformers' ``save_pretrained`` with a small ``max_shard_size``, as transformers'
own tests do) differs from its marker: ``verify`` lists each file and exits 1, resume refuses it naming the seal
command, and once sealed it resumes and ends equal to the uninterrupted run. ``seal`` refuses, writing nothing, a
folder that is not a whole, loadable checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from tests.checkpointing import seal_job
from tests.helpers.jobs import StopAt, make_args, weights
from tests.helpers.ranks import child_env, run_ranks
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Accelerator, Trainer
from trainer_ext.checkpointing import COMPLETE
from trainer_ext.checkpointing.marker import SAVING, read_marker, write_marker
from trainer_ext.cli.main import main
from trainer_ext.errors import ConfigError

pytestmark = pytest.mark.timeout(240)
DATA = lm_dataset(16, seed=3)
COMMON = dict(save_strategy="steps", save_steps=2, num_train_epochs=1)  # 8 steps of batch 2, saved every 2
SEAL = "trainer-ext checkpoint seal"


def _trainer(out: Path) -> Trainer:
    return Trainer(model=tiny_llama(0), args=make_args(out, **COMMON), train_dataset=DATA)


def _losses(trainer: Trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoint-2 and checkpoint-4 of a real run stopped at step 4 (copied per test)."""
    out = tmp_path_factory.mktemp("saved")
    trainer = _trainer(out)
    trainer.add_callback(StopAt(4))
    trainer.train()
    return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    trainer = _trainer(tmp_path_factory.mktemp("full"))
    trainer.train()
    return weights(trainer), _losses(trainer)


@pytest.fixture
def run_dir(saved: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    return out


def _cli(capsys: pytest.CaptureFixture, *argv: str | Path) -> tuple[int, str, str]:
    code = main(["checkpoint", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _reshard(folder: Path) -> list[str]:
    """Re-save the checkpoint's weights as several safetensors shards with an index, the whole file removed."""
    model = LlamaForCausalLM.from_pretrained(folder)
    model.save_pretrained(folder, max_shard_size="20KB")
    (folder / "model.safetensors").unlink()
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2, shards
    return shards


def test_a_fresh_checkpoint_verifies(run_dir: Path, capsys) -> None:
    code, out, _ = _cli(capsys, "verify", run_dir / "checkpoint-4")
    assert code == 0, out
    files = len(read_marker(run_dir / "checkpoint-4")["files"])
    assert f"verifies: {files} files as committed (trainer checkpoint, step 4, 1 process)" in out


def test_a_resharded_checkpoint_is_listed_refused_then_sealed_and_resumes_as_the_uninterrupted_run(
    run_dir: Path, full_run: tuple[dict, dict], capsys, caplog
) -> None:
    folder = run_dir / "checkpoint-4"
    before = read_marker(folder)
    shards = _reshard(folder)

    code, out, _ = _cli(capsys, "verify", folder)
    assert code == 1
    assert "model.safetensors is missing (listed in COMPLETE)" in out
    for name in [*shards, "model.safetensors.index.json"]:
        assert f"{name} is not listed in COMPLETE" in out, name
    assert f"{SEAL} {folder}" in out

    with pytest.raises(ConfigError, match=rf"refusing to resume .*model\.safetensors is missing.*`{SEAL} {folder}`"):
        _trainer(run_dir).resolve_resume(str(folder))
    with caplog.at_level("WARNING"):  # the newest one: skipped with the same words, checkpoint-2 taken
        assert _trainer(run_dir).resolve_resume(True) == str(run_dir / "checkpoint-2")
    assert "skipping checkpoint-4: model.safetensors is missing (listed in COMPLETE); if you changed" in caplog.text

    code, out, _ = _cli(capsys, "seal", folder)
    assert code == 0 and "the run's facts kept from the previous marker" in out
    after = read_marker(folder)
    assert set(shards) <= after["files"].keys() and "model.safetensors" not in after["files"]
    assert {k: v for k, v in after.items() if k not in ("files", "crc32", "marker_crc32")} == {
        k: v for k, v in before.items() if k not in ("files", "crc32", "marker_crc32")
    }
    assert _cli(capsys, "verify", folder)[0] == 0
    assert _cli(capsys, "seal", folder)[1].endswith("marker left as it is\n")

    resumed = _trainer(run_dir)
    resumed.train(resume_from_checkpoint=str(folder))
    expected, losses = full_run
    got = weights(resumed)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert _losses(resumed) == losses  # steps 1-4 from the checkpoint's state, 5-8 trained after the resume


def test_a_removed_marker_is_named_and_sealed_from_the_files(run_dir: Path, capsys) -> None:
    folder = run_dir / "checkpoint-4"
    (folder / COMPLETE).unlink()
    # a sibling has a marker: without one this is a save that did not finish, unless it was removed on purpose
    with pytest.raises(ConfigError, match=rf"no COMPLETE marker .*if you removed it on purpose, run `{SEAL} "):
        _trainer(run_dir).resolve_resume(str(folder))
    code, out, _ = _cli(capsys, "verify", folder)
    assert code == 1 and "no COMPLETE marker (never written, or removed)" in out

    code, out, _ = _cli(capsys, "seal", folder)
    assert code == 0 and "no valid previous marker" in out
    marker = read_marker(folder)
    assert (marker["kind"], marker["step"], marker["world_size"]) == ("trainer", 4, 1)
    assert "strategy" not in marker  # not known from the files
    assert _trainer(run_dir).resolve_resume(str(folder)) == str(folder)


def test_a_damaged_marker_is_reported_and_replaced(run_dir: Path, capsys) -> None:
    folder = run_dir / "checkpoint-2"
    text = (folder / COMPLETE).read_text()
    (folder / COMPLETE).write_text(text[: len(text) // 2])
    code, out, _ = _cli(capsys, "verify", folder)
    assert code == 1 and "COMPLETE is damaged (not valid JSON" in out
    assert _cli(capsys, "seal", folder)[0] == 0
    assert read_marker(folder)["step"] == 2
    assert _cli(capsys, "verify", folder)[0] == 0


def test_an_accelerator_state_without_its_marker_is_sealed_and_loads(tmp_path: Path, capsys) -> None:
    accelerator = Accelerator(cpu=True, seed=0)
    model = tiny_llama(0)
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    folder = Path(accelerator.save_state(tmp_path / "state"))
    saved = {name: value.detach().clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    (folder / COMPLETE).unlink()
    with pytest.raises(ConfigError, match=rf"no COMPLETE marker.*if you removed the marker on purpose, run `{SEAL} "):
        accelerator.load_state(folder)
    code, out, _ = _cli(capsys, "seal", folder)
    assert code == 0 and "(loop checkpoint, 1 process;" in out, out
    accelerator.load_state(folder)
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name


def _link_optimizer(folder: Path) -> None:
    outside = folder.parent.parent / "elsewhere.pt"
    shutil.copy(folder / "optimizer.pt", outside)
    (folder / "optimizer.pt").unlink()
    (folder / "optimizer.pt").symlink_to(outside)


def _delete_a_shard(folder: Path) -> None:
    (folder / _reshard(folder)[1]).unlink()


def _move_a_tensor(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"][first] = next(s for s in shards if s != index["weight_map"][first])
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


REFUSALS = {  # damage -> (what seal is given, relative to the run folder; what its one line says)
    "empty folder": (lambda f: f.parent.joinpath("empty").mkdir(), "empty", "is not a checkpoint"),
    "output folder": (lambda f: None, ".", "it holds checkpoint folders"),
    "a file": (lambda f: None, "checkpoint-4/config.json", "is not a folder"),
    "no such folder": (lambda f: None, "checkpoint-9", "no such folder"),
    "linked folder": (lambda f: f.parent.joinpath("linked").symlink_to(f), "linked", "is a symbolic link"),
    "linked file": (_link_optimizer, "checkpoint-4", "optimizer.pt is a symbolic link"),
    "unfinished save": (
        lambda f: ((f / COMPLETE).unlink(), (f / SAVING).touch()),
        "checkpoint-4",
        "a save into it did not finish",
    ),
    "shard deleted": (_delete_a_shard, "checkpoint-4", "names model-00002-of-"),
    "tensor in the wrong shard": (lambda f: (_reshard(f), _move_a_tensor(f)), "checkpoint-4", "does not hold it"),
    "no weights": (
        lambda f: (_reshard(f), (f / "model.safetensors.index.json").unlink()),
        "checkpoint-4",
        "is missing the model's weights",
    ),
    "not a trainer state": (
        lambda f: (f / "trainer_state.json").write_text("[]"),
        "checkpoint-4",
        "trainer_state.json is not a Trainer state",
    ),
}


@pytest.mark.parametrize("damage", REFUSALS)
def test_seal_refuses_what_is_not_a_whole_checkpoint_and_writes_nothing(run_dir: Path, capsys, damage: str) -> None:
    make, given, words = REFUSALS[damage]
    folder = run_dir / "checkpoint-4"
    make(folder)
    capsys.readouterr()  # the re-sharding's progress bars
    marker = (folder / COMPLETE).read_bytes() if (folder / COMPLETE).exists() else None
    code, out, err = _cli(capsys, "seal", run_dir / given)
    assert code == 2, out
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    assert ((folder / COMPLETE).read_bytes() if (folder / COMPLETE).exists() else None) == marker
    assert not (run_dir / COMPLETE).exists()


def test_verify_answers_bad_input_with_one_line(run_dir: Path, capsys) -> None:
    for given, words in (("checkpoint-4/config.json", "is not a folder"), (".", "it holds checkpoint folders")):
        code, _, err = _cli(capsys, "verify", run_dir / given)
        assert code == 2 and err.count("\n") == 1 and words in err, err
    code, _, err = _cli(capsys, "verify")
    assert code == 2 and "required: DIR" in err and err.count("\n") == 1


def test_the_marker_is_never_written_through_a_link(run_dir: Path) -> None:
    folder = run_dir / "checkpoint-2"
    victim = run_dir / "victim.txt"
    victim.write_text("keep me")
    (folder / f".{COMPLETE}.tmp").symlink_to(victim)  # a planted temporary file
    write_marker(folder, world_size=1, step=2)
    assert victim.read_text() == "keep me" and not (folder / COMPLETE).is_symlink()
    (folder / COMPLETE).unlink()
    (folder / COMPLETE).symlink_to(victim)  # the marker itself a link: replaced, not followed
    write_marker(folder, world_size=1, step=2)
    assert victim.read_text() == "keep me" and not (folder / COMPLETE).is_symlink()
    assert read_marker(folder)["step"] == 2


def test_exit_codes_from_the_command_line(run_dir: Path) -> None:
    folder = run_dir / "checkpoint-4"
    _reshard(folder)
    env = {**child_env(), "OMP_NUM_THREADS": "1"}

    def run(*argv: str | Path) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "trainer_ext", "checkpoint", *map(os.fspath, argv)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    verify = run("verify", folder)
    assert verify.returncode == 1 and "model.safetensors is missing" in verify.stdout, verify.stderr
    seal = run("seal", folder)
    assert seal.returncode == 0 and seal.stdout.startswith(f"sealed {folder}"), seal.stderr
    assert run("verify", folder).returncode == 0
    bad = run("seal", folder / "config.json")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


@pytest.mark.distributed
def test_a_two_process_checkpoint_resharded_and_sealed_without_its_marker_resumes_on_two_processes(
    tmp_path: Path, capsys
) -> None:
    """The marker gone too: seal reads the process count from the per-rank RNG files; the resume is bitwise."""
    run_ranks(seal_job, 2, str(tmp_path), "first")
    folder = tmp_path / "run" / "checkpoint-4"
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in folder.iterdir()}
    _reshard(folder)
    (folder / COMPLETE).unlink()
    code, out, _ = _cli(capsys, "seal", folder)
    assert code == 0, out
    marker = read_marker(folder)
    assert (marker["world_size"], marker["step"], marker["kind"]) == (2, 4, "trainer")
    run_ranks(seal_job, 2, str(tmp_path), "resume")
    full, resumed = load_file(tmp_path / "full.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
