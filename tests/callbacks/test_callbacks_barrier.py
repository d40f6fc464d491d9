"""BarrierCallback on one process: the stages it waits at, and reading gloo's report of missing ranks.

The barriers themselves (a normal run, a late rank) are tested on 2 ranks in test_callbacks_ranks.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.callbacks import BarrierCallback
from trainer_ext.callbacks.barrier import missing_ranks


@pytest.mark.parametrize(
    ("text", "ranks"),
    [
        ("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 1500 ms", [1, 3]),
        ("[Rank 0]: Rank 2 failed to pass monitoredBarrier in 10 ms", [2]),
        ("Connection closed by peer [127.0.0.1]:34516", []),
    ],
)
def test_missing_ranks_are_read_from_gloo_errors(text: str, ranks: list[int]) -> None:
    assert missing_ranks(text) == ranks


class StageRecorder(BarrierCallback):
    """Records the stages instead of waiting (one process has nobody to wait for)."""

    def __init__(self) -> None:
        super().__init__(timeout=5)
        self.stages: list[str] = []

    def wait(self, stage: str, args) -> None:
        self.stages.append(stage)
        super().wait(stage, args)


def test_stages_around_evaluation_saves_and_the_end(tmp_path: Path) -> None:
    """Evaluation at step 2, saves every epoch (2 steps each), 4 steps: each stage once, in the order it happens."""
    recorder = StageRecorder()
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="epoch"),
        train_dataset=lm_dataset(4),
        eval_dataset=lm_dataset(2, seed=1),
        callbacks=[recorder],
    )
    trainer.train()
    assert recorder.stages == [
        "before evaluation at step 2",
        "after evaluation at step 2",
        "before checkpoint save at the end of epoch 1 (step 2)",
        "after checkpoint save at step 2",
        "before evaluation at step 4",
        "after evaluation at step 4",
        "before checkpoint save at the end of epoch 2 (step 4)",
        "after checkpoint save at step 4",
        "at the end of training (step 4)",
    ]
    assert recorder.passed == []  # one process: no barrier was needed
