"""TRL's configs whose ``__post_init__`` derives fields re-base for ``adapt`` (GRPO/RLOO could not start), and an
adapted GRPO trainer trains on our engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")

from trainer_ext import TrainingArguments, adapt  # noqa: E402
from trainer_ext.trainer.adapt import rebase_arguments  # noqa: E402


@pytest.mark.parametrize("config", ["GRPOConfig", "RLOOConfig"])
@pytest.mark.parametrize("given", [{}, {"generation_batch_size": 8}, {"steps_per_generation": 2}])
def test_a_stock_config_with_derived_fields_rebases_unchanged(tmp_path: Path, config: str, given: dict) -> None:
    stock = getattr(trl, config)(
        output_dir=str(tmp_path), report_to="none", bf16=False, per_device_train_batch_size=4, num_generations=2,
        **given,
    )  # fmt: skip
    rebased = rebase_arguments(stock)
    assert isinstance(rebased, TrainingArguments) and isinstance(rebased, type(stock))
    for spec in dataclasses.fields(stock):
        if spec.init:
            assert getattr(rebased, spec.name) == getattr(stock, spec.name), spec.name


def test_an_adapted_grpo_trainer_trains_on_our_engine(tmp_path: Path) -> None:
    from tests.with_trl import script_fixtures
    from tests.with_trl.trl_job import model, tokenizer

    tok = tokenizer()
    rows = script_fixtures.rows("prompt", 8, seed=3)
    from datasets import Dataset

    args = trl.GRPOConfig(
        output_dir=str(tmp_path), report_to="none", bf16=False, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, max_steps=2, logging_steps=1, learning_rate=5e-3, seed=1,
    )  # fmt: skip
    trainer = adapt(trl.GRPOTrainer)(
        model=model("causal", len(tok), tok.pad_token_id),
        reward_funcs=script_fixtures.length_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    )
    assert type(trainer.accelerator).__name__ == "Engine"
    trainer.train()
    assert trainer.state.global_step == 2
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2]
