"""Ordinary ``transformers.Trainer`` usages, each checked against what transformers documents for it.

Written from transformers' documentation of the Trainer (callbacks, evaluation, prediction, checkpoints, optimizers,
schedulers, ``model_init``), not from its tests. The same scripts run against the stock Trainer with accelerate in
``tests/parity`` (its own environment); here they run on ``trainer_ext.Trainer`` and assert the documented results.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    DefaultFlowCallback,
    EarlyStoppingCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    get_linear_schedule_with_warmup,
)
from transformers.optimization import Adafactor

from tests.test_trainer_dropin import Regression, Rows, Stream
from tests.test_trainer_dropin import _args as dropin_args
from trainer_ext import Trainer, TrainingArguments


def _args(out: Path, **overrides) -> TrainingArguments:
    """The drop-in tests' arguments, logging every step and saving nothing unless asked."""
    return dropin_args(out, **{"logging_steps": 1, "save_strategy": "no", **overrides})


def _names(trainer: Trainer) -> list[str]:
    return [type(c).__name__ for c in trainer.callback_handler.callbacks]


def _manual_eval_loss(model: torch.nn.Module, rows) -> float:
    """Per-sample mean of the model's loss, one sample at a time (the documented eval_loss for a mean loss)."""
    model.eval()
    with torch.no_grad():
        losses = [float(model(r["x"][None], labels=r["labels"][None])["loss"]) for r in rows]
    return sum(losses) / len(losses)


# --- callbacks -------------------------------------------------------------------------------------------------


def test_default_callbacks_are_flow_and_progress(tmp_path: Path) -> None:
    assert _names(Trainer(model=Regression(), args=_args(tmp_path, disable_tqdm=False))) == [
        "DefaultFlowCallback",
        "ProgressCallback",
    ]
    assert _names(Trainer(model=Regression(), args=_args(tmp_path))) == ["DefaultFlowCallback", "PrinterCallback"]


def test_callbacks_added_in_order_then_popped_and_removed(tmp_path: Path) -> None:
    class A(TrainerCallback):
        pass

    class B(TrainerCallback):
        pass

    a = A()
    trainer = Trainer(model=Regression(), args=_args(tmp_path), callbacks=[a, B])
    assert _names(trainer) == ["DefaultFlowCallback", "A", "B", "PrinterCallback"]
    trainer.add_callback(EarlyStoppingCallback(early_stopping_patience=2))
    assert _names(trainer)[-1] == "EarlyStoppingCallback"
    assert trainer.pop_callback(a) is a
    trainer.remove_callback(B)
    trainer.remove_callback(PrinterCallback)
    assert _names(trainer) == ["DefaultFlowCallback", "EarlyStoppingCallback"]
    trainer.callback_handler.callbacks.insert(1, ProgressCallback())  # some scripts edit the list directly
    assert _names(trainer) == ["DefaultFlowCallback", "ProgressCallback", "EarlyStoppingCallback"]


def test_callback_events_arrive_in_transformers_order(tmp_path: Path) -> None:
    events: list[str] = []

    class Record(TrainerCallback):
        def __getattribute__(self, name):
            if name.startswith("on_"):
                events.append(name)
            return super().__getattribute__(name)

    args = _args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2)
    trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(16), eval_dataset=Rows(8))
    trainer.add_callback(Record())
    trainer.train()
    step = ["on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log"]
    assert events[:2] == ["on_train_begin", "on_epoch_begin"]
    assert events[2:7] == step and events[7:12] == step  # logging_steps=1: each step logs after it ends
    assert events.index("on_evaluate") < events.index("on_save") < events.index("on_train_end")
    assert events[-1] == "on_train_end"


# --- datasets, loaders, evaluation -----------------------------------------------------------------------------


def test_eval_loss_is_the_per_sample_mean_on_map_and_iterable_data(tmp_path: Path) -> None:
    trainer = Trainer(model=Regression(), args=_args(tmp_path))
    expected = _manual_eval_loss(trainer.model, Rows(66).rows)
    on_map = trainer.evaluate(eval_dataset=Rows(66))["eval_loss"]
    on_stream = trainer.evaluate(eval_dataset=Stream(66))["eval_loss"]
    assert on_map == pytest.approx(expected, rel=1e-6)
    assert on_stream == pytest.approx(expected, rel=1e-6)


def test_compute_metrics_sees_every_sample_once(tmp_path: Path) -> None:
    seen = {}

    def compute_metrics(prediction):
        seen["predictions"], seen["labels"] = prediction.predictions, prediction.label_ids
        return {"mae": float(np.abs(prediction.predictions - prediction.label_ids).mean())}

    trainer = Trainer(model=Regression(), args=_args(tmp_path), compute_metrics=compute_metrics)
    metrics = trainer.evaluate(eval_dataset=Rows(66))
    assert seen["predictions"].shape == (66,) and seen["labels"].shape == (66,)
    labels = np.array([float(r["labels"]) for r in Rows(66).rows], dtype=np.float32)
    np.testing.assert_allclose(seen["labels"], labels, rtol=1e-6)
    assert {"eval_loss", "eval_mae", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"} <= set(
        metrics
    )


def test_predict_returns_every_prediction_and_test_metrics(tmp_path: Path) -> None:
    trainer = Trainer(model=Regression(), args=_args(tmp_path))
    out = trainer.predict(Rows(19))
    assert out.predictions.shape == (19,) and out.label_ids.shape == (19,)
    assert {"test_loss", "test_runtime"} <= set(out.metrics)
    with torch.no_grad():
        direct = trainer.model.linear(torch.stack([r["x"] for r in Rows(19).rows])).squeeze(-1)
    np.testing.assert_allclose(out.predictions, direct.numpy(), rtol=1e-5, atol=1e-6)


def test_several_eval_sets_prefix_their_metrics(tmp_path: Path) -> None:
    args = _args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2)
    sets = {"small": Rows(8), "large": Rows(24)}
    trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(16), eval_dataset=sets)
    trainer.train()
    keys = {k for entry in trainer.state.log_history for k in entry}
    assert {"eval_small_loss", "eval_large_loss"} <= keys
    assert set(trainer.evaluate()) >= {"eval_small_loss", "eval_large_loss"}


def test_a_custom_loader_is_used_as_given(tmp_path: Path) -> None:
    batches: list[int] = []

    class Custom(Trainer):
        def get_train_dataloader(self):
            return torch.utils.data.DataLoader(Rows(24), batch_size=3, shuffle=False)

    class Sizes(TrainerCallback):
        def on_step_begin(self, args, state, control, train_dataloader=None, **kwargs):
            batches.append(state.global_step)

    trainer = Custom(model=Regression(), args=_args(tmp_path, num_train_epochs=1), train_dataset=Rows(24))
    trainer.add_callback(Sizes())
    assert trainer.train().global_step == 8  # 24 samples in batches of 3
    assert len(batches) == 8


# --- checkpoints -----------------------------------------------------------------------------------------------


def test_save_total_limit_keeps_the_newest_and_load_best_keeps_the_best(tmp_path: Path) -> None:
    args = _args(
        tmp_path,
        max_steps=8,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        learning_rate=0.02,
    )
    trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(64), eval_dataset=Rows(16))
    trainer.train()
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    best = min(evals, key=evals.get)
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best}")
    kept = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    # the newest save_total_limit checkpoints, the best one always among them
    assert kept == (["checkpoint-6", "checkpoint-8"] if best == 8 else sorted([f"checkpoint-{best}", "checkpoint-8"]))
    # the model in memory is the best checkpoint's
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[best], rel=1e-6)


def test_save_total_limit_alone_rotates_oldest_first(tmp_path: Path) -> None:
    args = _args(tmp_path, max_steps=6, save_strategy="steps", save_steps=1, save_total_limit=3)
    Trainer(model=Regression(), args=args, train_dataset=Rows(32)).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5", "checkpoint-6"]


# --- optimizers and schedulers ---------------------------------------------------------------------------------


def test_the_linear_schedule_with_warmup_is_transformers_formula(tmp_path: Path) -> None:
    args = _args(tmp_path, max_steps=10, warmup_steps=3, lr_scheduler_type="linear", learning_rate=0.1)
    trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(64))
    trainer.train()
    logged = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    schedule = get_linear_schedule_with_warmup(probe, 3, 10)
    expected = []
    for _ in range(10):  # transformers logs the rate used by the step that just ran
        expected.append(schedule.get_last_lr()[0])
        probe.step()
        schedule.step()
    assert logged == pytest.approx(expected, rel=1e-9)


def test_a_users_optimizer_and_scheduler_are_the_ones_stepped(tmp_path: Path) -> None:
    model = Regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    args = _args(tmp_path, max_steps=6)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(32), optimizers=(optimizer, scheduler))
    trainer.train()
    assert trainer.lr_scheduler is scheduler
    logged = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    assert logged == pytest.approx([0.2, 0.2, 0.1, 0.1, 0.05, 0.05])
    assert optimizer.state[model.linear.weight]["momentum_buffer"] is not None  # the user's optimizer stepped


def test_reduce_lr_on_plateau_steps_on_the_evaluation_metric(tmp_path: Path) -> None:
    args = _args(
        tmp_path,
        max_steps=8,
        eval_strategy="steps",
        eval_steps=1,
        lr_scheduler_type="reduce_lr_on_plateau",
        lr_scheduler_kwargs={"patience": 0, "factor": 0.5},
        learning_rate=10.0,  # diverges: every evaluation is worse than the best, so the rate halves each time
    )
    trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(64), eval_dataset=Rows(8))
    trainer.train()
    assert isinstance(trainer.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    rates = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    assert rates[0] == 10.0 and rates[-1] < rates[0]
    assert all(later <= earlier for earlier, later in zip(rates, rates[1:], strict=False))


def test_adafactor_is_transformers_adafactor(tmp_path: Path) -> None:
    args = _args(tmp_path, max_steps=3, optim="adafactor")
    trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(32))
    trainer.train()
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(inner, Adafactor)
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


def test_model_init_builds_the_same_model_for_every_run(tmp_path: Path) -> None:
    calls: list[int] = []

    def model_init():
        calls.append(1)
        return Regression(seed=len(calls))  # a different seed each call: train() must call it again

    args = _args(tmp_path, max_steps=2)
    trainer = Trainer(model_init=model_init, args=args, train_dataset=Rows(16))
    assert len(calls) == 1 and isinstance(trainer.model, Regression)
    trainer.train()
    assert len(calls) == 2  # train() re-creates the model from model_init, as documented


def test_gradient_accumulation_matches_the_big_batch(tmp_path: Path) -> None:
    def run(out: Path, batch: int, steps: int) -> torch.Tensor:
        args = _args(out, per_device_train_batch_size=batch, gradient_accumulation_steps=steps, max_steps=4)
        trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(64))
        trainer.train()
        return trainer.model.linear.weight.detach().clone()

    torch.testing.assert_close(run(tmp_path / "a", 8, 1), run(tmp_path / "b", 2, 4), rtol=1e-5, atol=1e-6)


def test_default_flow_decides_logging_evaluation_and_saving(tmp_path: Path) -> None:
    args = _args(tmp_path, max_steps=6, logging_steps=2, eval_strategy="steps", eval_steps=3, save_strategy="no")
    trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(64), eval_dataset=Rows(8))
    assert isinstance(trainer.callback_handler.callbacks[0], DefaultFlowCallback)
    trainer.train()
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [2, 4, 6]
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [3, 6]
    assert not list(tmp_path.glob("checkpoint-*"))
