"""``Accelerator.load_state`` of a folder written by accelerate's ``save_state`` (layout: ``accelerate_layout.py``):
what is restored, what is refused (crafted pickles, half-written folders, plugin layouts) and automatic naming.

The end-to-end proof against accelerate itself is ``tests/accelerator_parity/test_migrate_from_accelerate.py``.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpointing import accelerate_layout as layout
from tests.checkpointing import accelerate_migration_job as job
from tests.helpers.ranks import run_ranks
from trainer_ext import Accelerator, ProjectConfiguration
from trainer_ext.checkpointing.accelerate_format import is_accelerate_checkpoint
from trainer_ext.errors import ConfigError

pytestmark = pytest.mark.timeout(120)
NOTICE = "loading accelerate checkpoint"


def _prepared(project: Path | None = None, **project_config):
    """A fresh Accelerator with a model, AdamW and a linear schedule prepared (the same initial weights each time)."""
    config = ProjectConfiguration(project_dir=str(project), **project_config) if project is not None else None
    accelerator = Accelerator(cpu=True, project_config=config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=10)
    return accelerator, *accelerator.prepare(model, optimizer, scheduler)


def _train(accelerator, model, optimizer, scheduler, steps: int = 2) -> None:
    for _ in range(steps):
        accelerator.backward(model(torch.ones(2, 3)).pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _saved_by_accelerate(folder: Path, counter: layout.Counter | None = None, steps: int = 2, **options) -> dict:
    """Train ``steps`` steps, write the folder as accelerate would, and return what loading it must give back."""
    accelerator, model, optimizer, scheduler = _prepared()
    _train(accelerator, model, optimizer, scheduler, steps)
    custom = (counter,) if counter is not None else ()
    layout.write(folder, model, optimizer.optimizer, scheduler.scheduler, custom, step=7, **options)
    expected = {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "exp_avg": optimizer.optimizer.state_dict()["state"][0]["exp_avg"].clone(),
        "lr": scheduler.get_last_lr()[0],
        "draws": (torch.rand(3), random.random(), np.random.rand()),  # what the restored generators draw next
    }
    return expected


@pytest.mark.parametrize(
    ("safe", "prefix"), [(True, ""), (False, ""), (True, "module."), (False, "_orig_mod.module.")]
)
def test_an_accelerate_folder_is_restored_as_accelerate_restores_it(tmp_path: Path, caplog, safe, prefix) -> None:
    """Weights (safetensors or torch.save; named as DDP and a compiled DDP model name them too), optimizer,
    scheduler, registered object, the step counter and every generator; the notice once, accelerate's lines."""
    folder = tmp_path / "ck"
    expected = _saved_by_accelerate(folder, layout.Counter(5), safe=safe, prefix=prefix)
    accelerator, model, optimizer, scheduler = _prepared()
    counter = layout.Counter()
    accelerator.register_for_checkpointing(counter)
    with caplog.at_level(logging.INFO):
        accelerator.load_state(str(folder))
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected["weights"][name]), name
    assert torch.equal(optimizer.optimizer.state_dict()["state"][0]["exp_avg"], expected["exp_avg"])
    assert scheduler.get_last_lr()[0] == expected["lr"]
    assert counter.count == 5 and accelerator.step == 7
    draws = expected["draws"]
    assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1] and np.random.rand() == draws[2]
    assert caplog.text.count(NOTICE) == 1
    assert f"[RANK 0] Loading states from {folder}" in caplog.text
    assert "[RANK 0] All model weights loaded successfully" in caplog.text
    assert f"[RANK 0] Loading the state of Counter from {folder / 'custom_checkpoint_0.pkl'}" in caplog.text


def test_a_crafted_random_states_pickle_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    _saved_by_accelerate(folder)
    ran = tmp_path / "code_ran"
    torch.save({**layout.random_states(), "random_state": layout.Touch(ran)}, folder / "random_states_0.pkl")
    accelerator, model, *_ = _prepared()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as refused:
        accelerator.load_state(str(folder))
    message = str(refused.value)
    assert "\n" not in message
    assert "random_states_0.pkl' holds objects that only a full unpickle could rebuild" in message
    assert message.endswith("which could run code: refused, nothing in it was run")
    assert not ran.exists()
    for name, value in model.state_dict().items():  # everything is read and checked before anything is loaded
        assert torch.equal(value, before[name]), name


def test_a_crafted_registered_object_state_is_refused(tmp_path: Path) -> None:
    """accelerate unpickles custom_checkpoint_<i>.pkl in full; we read it weights-only like every other file."""
    folder = tmp_path / "ck"
    _saved_by_accelerate(folder, layout.Counter())
    ran = tmp_path / "code_ran"
    torch.save({"count": layout.Touch(ran), "seen": torch.zeros(2)}, folder / "custom_checkpoint_0.pkl")
    accelerator, *_ = _prepared()
    accelerator.register_for_checkpointing(layout.Counter())
    with pytest.raises(ConfigError, match=r"custom_checkpoint_0\.pkl.*refused.*load the file yourself") as refused:
        accelerator.load_state(str(folder))
    assert "\n" not in str(refused.value) and not ran.exists()


@pytest.mark.parametrize(
    ("remove", "named"),
    [
        ("model.safetensors", r"model\.safetensors \(or pytorch_model\.bin\)"),
        ("random_states_0.pkl", r"random_states_0\.pkl"),
        ("scheduler.bin", r"scheduler\.bin"),
    ],
)
def test_a_half_written_accelerate_folder_names_what_is_missing(tmp_path: Path, remove: str, named: str) -> None:
    folder = tmp_path / "ck"
    _saved_by_accelerate(folder)
    (folder / remove).unlink()
    accelerator, *_ = _prepared()
    with pytest.raises(ConfigError, match=rf"is an accelerate checkpoint without {named}: interrupted") as refused:
        accelerator.load_state(str(folder))
    assert "\n" not in str(refused.value) and "COMPLETE" not in str(refused.value)


def test_registered_objects_must_match_the_custom_checkpoints(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    _saved_by_accelerate(folder, layout.Counter())
    accelerator, *_ = _prepared()
    with pytest.raises(ConfigError, match=r"holds 1 custom checkpoint\(s\) .* but 0 object\(s\) are registered"):
        accelerator.load_state(str(folder))


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ("pytorch_model_fsdp_0/", "its FSDP plugin (pytorch_model_fsdp_0)"),
        ("pytorch_model/", "its DeepSpeed plugin (pytorch_model/)"),
        ("dl_state_dict.bin", "holds dl_state_dict.bin, a dataloader position saved by accelerate's"),
    ],
)
def test_layouts_it_cannot_continue_are_refused_in_one_line(tmp_path: Path, entry: str, said: str) -> None:
    folder = tmp_path / "ck"
    _saved_by_accelerate(folder)
    if entry.endswith("/"):
        (folder / entry).mkdir()
        (folder / "model.safetensors").unlink()
    else:
        torch.save({}, folder / entry)
    accelerator, *_ = _prepared()
    with pytest.raises(ConfigError) as refused:
        accelerator.load_state(str(folder))
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_automatic_naming_continues_from_accelerate_numbering(tmp_path: Path) -> None:
    """``load_state()`` takes accelerate's highest ``checkpoint_<n>``; the next save is ``checkpoint_<n+1>``, then
    that one (ours) is the newest; an ``iteration`` set past it is kept."""
    root = tmp_path / "checkpoints"
    older = _saved_by_accelerate(root / "checkpoint_0", steps=1)
    newer = _saved_by_accelerate(root / "checkpoint_1", steps=2)
    accelerator, model, optimizer, scheduler = _prepared(tmp_path, automatic_checkpoint_naming=True)
    accelerator.load_state()
    assert all(torch.equal(v, newer["weights"][k]) for k, v in model.state_dict().items())
    assert accelerator.save_iteration == 2
    _train(accelerator, model, optimizer, scheduler, steps=1)
    assert Path(accelerator.save_state()).name == "checkpoint_2"
    trained = {k: v.clone() for k, v in model.state_dict().items()}

    accelerator, model, *_ = _prepared(tmp_path, automatic_checkpoint_naming=True, iteration=9)
    accelerator.load_state()
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())  # ours, checkpoint_2
    assert accelerator.save_iteration == 9
    shutil.rmtree(root / "checkpoint_2")
    accelerator.load_state(str(root / "checkpoint_0"))
    assert accelerator.save_iteration == 9
    assert all(torch.equal(v, older["weights"][k]) for k, v in model.state_dict().items())


def test_our_own_folders_are_not_taken_for_accelerate_ones(tmp_path: Path, caplog) -> None:
    """Ours write state.json beside the same file names: their loader and its refusals are unchanged."""
    accelerator, model, optimizer, scheduler = _prepared()
    _train(accelerator, model, optimizer, scheduler)
    with caplog.at_level(logging.INFO):
        folder = Path(accelerator.save_state(str(tmp_path / "ours")))
    assert not is_accelerate_checkpoint(folder)
    for line in (
        f"Saving current state to {folder}",
        f"Model weights saved in {folder / 'model.safetensors'}",
        f"Optimizer state saved in {folder / 'optimizer.bin'}",
        f"Random states saved in {folder / 'random_states_0.pkl'}",
    ):
        assert f"[RANK 0] {line}" in caplog.text
    (folder / "COMPLETE").unlink()
    with pytest.raises(ConfigError, match="is not a complete checkpoint .*checkpoint seal"):
        _prepared()[0].load_state(str(folder))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_processes_refuse_together_and_fsdp_takes_whole_files(tmp_path: Path) -> None:
    """A crafted ``random_states_1.pkl`` (read by process 1 only) stops both processes with its refusal, none
    hangs; an accelerate folder written under DDP (``module.`` names) loads into FSDP shards whole."""
    run_ranks(job.__name__, 2, str(tmp_path), timeout=300)
    results = job.results(tmp_path)
    on_0, on_1 = results["crafted"]
    refusal = "'<DIR>/random_states_1.pkl' holds objects that only a full unpickle could rebuild"
    assert on_1.startswith(refusal) and "\n" not in on_1
    assert on_0 == f"load_state: '<DIR>' could not be loaded on process 1: {on_1}"
    assert not (tmp_path / "code_ran").exists()
    assert results["fsdp"] == {"weights_equal": True, "exp_avg_equal": True, "step": 3}


def test_save_state_without_safe_serialization_still_saves_and_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """accelerate's scripts may pass ``safe_serialization=False``: ours saves (safetensors, said once) and resumes."""
    accelerator, model, optimizer, scheduler = _prepared()
    _train(accelerator, model, optimizer, scheduler)
    with caplog.at_level(logging.WARNING):
        accelerator.save_state(str(tmp_path / "a"), safe_serialization=False)
        accelerator.save_state(str(tmp_path / "b"), safe_serialization=False)
    assert sum("safe_serialization=False" in r.getMessage() for r in caplog.records) == 1
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    again, model2, _, _ = _prepared()
    again.load_state(str(tmp_path / "a"))
    for key, value in model2.state_dict().items():
        assert torch.equal(value, saved[key])
