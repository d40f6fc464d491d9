"""The engine's duties run as callbacks that ``trainer.callback_handler.callbacks`` does not list (transformers' list
stays as it is); a user's own listed instance takes a duty's place; the extras are switched on by flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import DefaultFlowCallback, PrinterCallback, TrainerCallback

from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.callbacks import (
    BarrierCallback,
    MainProcessLoggingCallback,
    RunSummaryCallback,
    UnwrapAndSaveCallback,
)
from trainer_ext.checkpointing import PreemptionCallback

DUTIES = (MainProcessLoggingCallback, BarrierCallback, UnwrapAndSaveCallback)


def _trainer(out: Path, args: dict | None = None, **kwargs) -> Trainer:
    return Trainer(
        model=tiny_llama(0),
        args=make_args(out, max_steps=1, **(args or {})),
        train_dataset=lm_dataset(4),
        **kwargs,
    )


def _names(trainer: Trainer) -> list[str]:
    return [type(callback).__name__ for callback in trainer.callback_handler.callbacks]


def test_the_callback_list_is_transformers_own(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    assert _names(trainer) == ["DefaultFlowCallback", "PrinterCallback"]  # disable_tqdm: the printer, as upstream
    assert [type(d) for d in trainer.callback_handler.duties] == list(DUTIES)


def test_the_list_seen_during_training_is_transformers_own(tmp_path: Path) -> None:
    seen: list[list[str]] = []

    class Look(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.append(_names(trainer))

    trainer = _trainer(tmp_path, args={"save_on_preemption": True, "run_summary": True}, callbacks=[Look()])
    trainer.train()
    assert seen == [["DefaultFlowCallback", "Look", "PrinterCallback"]]
    assert any(isinstance(d, PreemptionCallback) for d in trainer.callback_handler.duties)  # opted in, not listed


def test_pop_remove_and_replace_work_on_the_list_as_upstream(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    popped = trainer.pop_callback(PrinterCallback)
    assert isinstance(popped, PrinterCallback) and _names(trainer) == ["DefaultFlowCallback"]
    trainer.remove_callback(DefaultFlowCallback)
    assert _names(trainer) == []
    trainer.add_callback(DefaultFlowCallback)
    assert _names(trainer) == ["DefaultFlowCallback"]


@pytest.mark.parametrize("duty", DUTIES)
def test_a_users_instance_takes_the_duty_place(tmp_path: Path, duty: type) -> None:
    mine = duty(timeout=7) if duty is BarrierCallback else duty(None)
    trainer = _trainer(tmp_path, callbacks=[mine])
    handler = trainer.callback_handler
    assert [c for c in handler.callbacks if isinstance(c, duty)] == [mine]
    assert handler.duty(duty) is mine
    assert all(not isinstance(d, duty) for d in handler._active_duties())


def test_a_users_subclass_takes_the_duty_place(tmp_path: Path) -> None:
    class QuickBarrier(BarrierCallback):
        pass

    mine = QuickBarrier(timeout=7)
    trainer = _trainer(tmp_path, callbacks=[mine])
    assert trainer.callback_handler.duty(BarrierCallback) is mine


def test_without_the_flags_nothing_is_written_that_transformers_would_not_write(tmp_path: Path, capsys) -> None:
    trainer = _trainer(tmp_path)
    trainer.train()
    assert not (tmp_path / "model.safetensors").exists() and not (tmp_path / "config.json").exists()
    assert "trainer_ext: one optimizer step" not in capsys.readouterr().out


def test_the_flags_switch_the_extras_on(tmp_path: Path, capsys) -> None:
    trainer = _trainer(tmp_path, args={"save_final_model": True, "run_summary": True})
    trainer.train()
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    assert "trainer_ext: one optimizer step" in capsys.readouterr().out
    assert trainer.callback_handler.duty(RunSummaryCallback).printed is not None
    assert _names(trainer) == ["DefaultFlowCallback", "PrinterCallback"]
