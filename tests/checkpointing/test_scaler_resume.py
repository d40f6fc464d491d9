"""The fp16 loss scaler's state survives a checkpoint: ``Accelerator.save_state`` and the Trainer's ``scaler.pt``.

fp16 needs an accelerator, so these put a real ``torch.amp.GradScaler`` (on the test device, tests/helpers/device.py)
where the engine keeps its scaler; the save and resume paths are the ones a GPU run takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.device import chosen_device, use_cpu
from tests.helpers.jobs import StopAt, make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Accelerator, Trainer
from trainer_ext.checkpointing import COMPLETE

pytestmark = pytest.mark.timeout(180)
BATCH = {k: torch.tensor(v) for k, v in lm_dataset(2, seed=1)[:2].items()}


def _scaler() -> torch.amp.GradScaler:
    """Doubles its scale after every step without inf/NaN: the scale counts the steps it has seen."""
    return torch.amp.GradScaler(chosen_device(), init_scale=2.0**10, growth_interval=1)


def _accelerator(project: Path) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer]:
    accelerator = Accelerator(cpu=use_cpu(), project_dir=project, seed=0)
    accelerator.engine.precision.scaler = _scaler()
    model = tiny_llama(0)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return accelerator, model, optimizer


def test_accelerator_save_state_restores_the_scaler(tmp_path: Path) -> None:
    accelerator, model, optimizer = _accelerator(tmp_path)
    batch = {k: v.to(accelerator.device) for k, v in BATCH.items()}
    for _ in range(3):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    saved = accelerator.scaler.state_dict()
    assert saved["scale"] == 2.0**13, "the scaler took part in the steps"
    folder = Path(accelerator.save_state())
    assert (folder / "scaler.pt").is_file()
    again, _, _ = _accelerator(tmp_path)
    again.load_state(folder)
    assert again.scaler.state_dict() == saved


def _trainer(out: Path, callbacks=()) -> Trainer:
    args = make_args(out, save_strategy="steps", save_steps=2, num_train_epochs=1, learning_rate=1e-3)
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=lm_dataset(16, seed=3), callbacks=list(callbacks))
    trainer.accelerator.precision.scaler = _scaler()
    return trainer


def test_trainer_resume_restores_the_scaler(tmp_path: Path) -> None:
    full = _trainer(tmp_path / "full")
    full.train()
    part = _trainer(tmp_path / "part", callbacks=[StopAt(4)])
    part.train()
    assert "scaler.pt" in (tmp_path / "part" / "checkpoint-4" / COMPLETE).read_text()
    resumed = _trainer(tmp_path / "part")
    resumed.train(resume_from_checkpoint="auto")
    assert full.state.global_step == resumed.state.global_step == 8
    assert resumed.accelerator.scaler.state_dict() == full.accelerator.scaler.state_dict()
    assert resumed.accelerator.scaler.get_scale() == 2.0 ** (10 + 8)
