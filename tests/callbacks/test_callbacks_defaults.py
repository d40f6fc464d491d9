"""The callbacks ``trainer_ext.Trainer`` installs by default, once each, and a user's own instance in their place."""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs import make_args
from tiny import lm_dataset, tiny_llama

from trainer_ext import Trainer
from trainer_ext.callbacks import BarrierCallback, MainProcessLoggingCallback, UnwrapAndSaveCallback

DEFAULTS = (MainProcessLoggingCallback, BarrierCallback, UnwrapAndSaveCallback)


def _trainer(out: Path, **kwargs) -> Trainer:
    return Trainer(model=tiny_llama(0), args=make_args(out, max_steps=1), train_dataset=lm_dataset(4), **kwargs)


def test_the_trainer_installs_the_default_callbacks_once_each(tmp_path: Path) -> None:
    kinds = [type(callback) for callback in _trainer(tmp_path).callback_handler.callbacks]
    assert [kinds.count(default) for default in DEFAULTS] == [1, 1, 1]


@pytest.mark.parametrize("default", DEFAULTS)
def test_a_users_instance_takes_the_defaults_place(tmp_path: Path, default: type) -> None:
    mine = default(timeout=7) if default is BarrierCallback else default(None)
    trainer = _trainer(tmp_path, callbacks=[mine])
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, default)] == [mine]


def test_a_users_subclass_takes_the_defaults_place(tmp_path: Path) -> None:
    class QuickBarrier(BarrierCallback):
        pass

    mine = QuickBarrier(timeout=7)
    trainer = _trainer(tmp_path, callbacks=[mine])
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, BarrierCallback)] == [mine]
