"""The per-step work transformers repeats (``model.train()``, the FLOP count) done once: same results as doing it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback

from tests.helpers.jobs import make_args, weights
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer


class EvalOneLayer(TrainerCallback):
    """A user's callback that puts one decoder layer in eval mode before every step (the step puts it back)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layer = model.model.layers[0]
        self.seen: list[bool] = []
        self.layer.register_forward_pre_hook(lambda module, args: self.seen.append(module.training))

    def on_step_begin(self, args, state, control, **kwargs):
        self.layer.eval()


class TrainCalls:
    """Counts the ``nn.Module.train`` walks that reach the decoder (every ``model.train()`` of the root does)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        original = torch.nn.Module.train

        def counted(module: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
            if module is model.model:
                self.calls += 1
            return original(module, mode)

        self.counted = counted


def _trainer(out: Path, callbacks=(), **overrides) -> Trainer:
    model = tiny_llama(0)
    args = make_args(out, max_steps=6, num_train_epochs=1, **overrides)
    return Trainer(model=model, args=args, train_dataset=lm_dataset(16, seed=1), callbacks=list(callbacks))


def test_a_module_put_in_eval_mode_trains_again_at_the_next_step(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    spy = EvalOneLayer(trainer.model)
    trainer.add_callback(spy)
    trainer.train()
    assert spy.seen == [True] * 6, "transformers' training_step puts every module back in training mode"


def test_model_train_walks_the_modules_only_when_a_mode_changes(tmp_path: Path, monkeypatch) -> None:
    trainer = _trainer(tmp_path)
    trainer.model.eval()
    counter = TrainCalls(trainer.model)
    monkeypatch.setattr(torch.nn.Module, "train", counter.counted)
    trainer.train()
    assert counter.calls == 1, "one walk at the first step (the model was in eval mode), none after"
    assert all(module.training for module in trainer.model.modules())


def test_train_false_inside_a_step_still_switches_to_eval(tmp_path: Path) -> None:
    class EvalInsideStep(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            model.train(False)
            modes.append(all(not m.training for m in model.modules()))
            model.train()
            modes.append(all(m.training for m in model.modules()))
            return super().compute_loss(model, inputs, *args, **kwargs)

    modes: list[bool] = []
    args = make_args(tmp_path, max_steps=3, num_train_epochs=1)
    EvalInsideStep(model=tiny_llama(0), args=args, train_dataset=lm_dataset(8, seed=1)).train()
    assert modes == [True] * 6, "a user's train(False) and train() inside the step both take effect"


def test_the_flop_count_is_transformers_formula_counted_once(tmp_path: Path, monkeypatch) -> None:
    trainer = _trainer(tmp_path)
    counted = []
    original = type(trainer.model).num_parameters

    def num_parameters(model, *args, **kwargs):
        counted.append(kwargs)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(type(trainer.model), "num_parameters", num_parameters)
    trainer.train()
    expected_per_token = 6 * original(trainer.model, exclude_embeddings=True)
    tokens = 6 * 2 * 12  # 6 steps, batch 2, 12 tokens each
    assert trainer.state.total_flos == expected_per_token * tokens
    assert counted.count({"exclude_embeddings": True}) == 1


def test_the_same_weights_as_with_the_repeated_work(tmp_path: Path, monkeypatch) -> None:
    lean = _trainer(tmp_path / "lean")
    lean.train()
    from trainer_ext.trainer.lean_step import LeanStepMixin

    monkeypatch.delattr(LeanStepMixin, "training_step")
    monkeypatch.delattr(LeanStepMixin, "floating_point_ops")
    stock = _trainer(tmp_path / "stock")
    stock.train()
    a, b = weights(lean), weights(stock)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert lean.state.total_flos == stock.state.total_flos
    assert [e.get("loss") for e in lean.state.log_history] == [e.get("loss") for e in stock.state.log_history]
