"""``trainer_ext.adapt``: a Trainer subclass with its own arguments class runs on our engine, its arguments re-based.

A stand-in for TRL's pattern (a config dataclass with its own fields, defaults and ``__post_init__``; a trainer that
insists on that config and builds a default one). TRL itself is tested in tests/with_trl (it needs accelerate).
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from pathlib import Path

import pytest
import torch
import transformers
from transformers.trainer_utils import IntervalStrategy

import trainer_ext
from trainer_ext.distributed.engine import Engine
from trainer_ext.trainer.adapt import rebase_arguments, rebased_arguments_class

from .helpers.tiny import lm_dataset, tiny_llama


@dataclasses.dataclass
class LoopConfig(transformers.TrainingArguments):
    """Its own field, its own default for a transformers field, its own checks."""

    learning_rate: float = dataclasses.field(default=3e-3, metadata={"help": "The initial learning rate."})
    margin: float = dataclasses.field(default=0.5, metadata={"help": "A field transformers does not know."})

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise ValueError("margin must not be negative")
        super().__post_init__()
        self.margin_seen_by_post_init = self.margin


class LoopTrainer(transformers.Trainer):
    """Refuses other arguments and builds its own default, as TRL's trainers do."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: LoopConfig | transformers.TrainingArguments | None = None,
        train_dataset: object = None,
        **kwargs: object,
    ) -> None:
        if args is None:
            args = LoopConfig(output_dir="loop-default")
        if not isinstance(args, LoopConfig):
            raise TypeError("LoopTrainer needs a LoopConfig")
        self.built_with_margin = args.margin
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        loss = loss * (1.0 + self.args.margin)  # the trainer's own field reaches its own loss
        return (loss, outputs) if return_outputs else loss


def _config(tmp_path: Path, **overrides: object) -> LoopConfig:
    values = dict(output_dir=str(tmp_path / "out"), report_to="none", max_steps=3, per_device_train_batch_size=4)
    return rebased_arguments_class(LoopConfig)(**(values | overrides))


def test_the_rebased_arguments_are_both_classes_with_the_foreign_defaults_and_checks(tmp_path: Path) -> None:
    args = _config(tmp_path, margin=0.25, fp16_init_scale=1024.0)
    assert isinstance(args, LoopConfig) and isinstance(args, trainer_ext.TrainingArguments)
    assert type(args).__name__ == "LoopConfig"
    assert args.learning_rate == 3e-3  # LoopConfig's default, not transformers' 5e-5
    assert args.margin_seen_by_post_init == 0.25 and args.fp16_init_scale == 1024.0
    assert args.device.type == "cpu" and isinstance(args.distributed_state, trainer_ext.DistState)  # our set-up
    with pytest.raises(trainer_ext.ConfigError, match="margin must not be negative"):
        _config(tmp_path, margin=-1.0)


def test_our_fields_survive_to_dict_and_replace_round_trips(tmp_path: Path) -> None:
    args = _config(tmp_path, margin=0.75, fp16_init_scale=512.0, save_final_model=True, eval_strategy="no")
    again = type(args)(**args.to_dict())
    replaced = dataclasses.replace(args, max_steps=9)
    ours = trainer_ext.TrainingArguments(output_dir=str(tmp_path), fp16_init_scale=256.0, run_summary=True)
    plain_again = trainer_ext.TrainingArguments(**ours.to_dict())
    for copy_ in (again, replaced):
        assert (copy_.margin, copy_.fp16_init_scale, copy_.save_final_model) == (0.75, 512.0, True)
        assert copy_.eval_strategy == IntervalStrategy.NO
    assert replaced.max_steps == 9
    assert (plain_again.fp16_init_scale, plain_again.run_summary) == (256.0, True)


def test_rebasing_keeps_every_field_and_pickles_by_the_original_class(tmp_path: Path) -> None:
    args = _config(tmp_path, margin=0.1, weight_decay=0.01)
    assert rebase_arguments(args) is args  # already ours
    loaded = pickle.loads(pickle.dumps(args))  # training_args.bin
    assert type(loaded) is type(args) and loaded.margin == 0.1 and loaded.weight_decay == 0.01
    assert rebased_arguments_class(LoopConfig) is type(args)  # cached
    assert rebased_arguments_class(transformers.TrainingArguments) is trainer_ext.TrainingArguments
    with pytest.raises(trainer_ext.ConfigError, match="not a transformers.TrainingArguments subclass"):
        rebased_arguments_class(dict)


def test_adapt_gives_a_cached_subclass_that_keeps_the_trainers_signature() -> None:
    adapted = trainer_ext.adapt(LoopTrainer)
    assert trainer_ext.adapt(LoopTrainer) is adapted
    assert issubclass(adapted, LoopTrainer) and issubclass(adapted, trainer_ext.Trainer)
    assert adapted.__name__ == "LoopTrainer"
    assert list(inspect.signature(adapted).parameters)[:3] == ["model", "args", "train_dataset"]
    assert trainer_ext.adapt(transformers.Trainer) is trainer_ext.Trainer
    assert trainer_ext.adapt(trainer_ext.Trainer) is trainer_ext.Trainer
    with pytest.raises(trainer_ext.ConfigError, match="takes a transformers.Trainer subclass"):
        trainer_ext.adapt(torch.nn.Module)


def test_an_adapted_trainer_trains_on_our_engine_with_its_own_arguments(tmp_path: Path) -> None:
    args = _config(tmp_path, margin=0.5, logging_steps=1)
    trainer = trainer_ext.adapt(LoopTrainer)(tiny_llama(), args, lm_dataset(12))  # positional, as the trainer takes
    assert isinstance(trainer.accelerator, Engine) and trainer.args is args and trainer.built_with_margin == 0.5
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]

    plain = trainer_ext.Trainer(
        model=tiny_llama(),
        args=trainer_ext.TrainingArguments(
            output_dir=str(tmp_path / "plain"), report_to="none", max_steps=3, per_device_train_batch_size=4,
            learning_rate=3e-3, logging_steps=1,
        ),
        train_dataset=lm_dataset(12),
    )  # fmt: skip
    plain.train()
    plain_losses = [e["loss"] for e in plain.state.log_history if "loss" in e]
    # the first step's loss is the same model on the same batch, scaled by the trainer's own (1 + margin)
    assert losses[0] == pytest.approx(1.5 * plain_losses[0], rel=1e-5)
    assert (tmp_path / "out" / "checkpoint-3" / "training_args.bin").exists()
    loaded = torch.load(tmp_path / "out" / "checkpoint-3" / "training_args.bin", weights_only=False)
    assert isinstance(loaded, LoopConfig) and loaded.margin == 0.5


def test_without_arguments_the_adapted_trainer_builds_its_own_config_rebased(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    trainer = trainer_ext.adapt(LoopTrainer)(model=tiny_llama())
    assert isinstance(trainer.args, LoopConfig) and isinstance(trainer.args, trainer_ext.TrainingArguments)
    assert trainer.args.output_dir == "tmp_trainer" and trainer.args.learning_rate == 3e-3


def test_our_trainer_given_another_trainers_arguments_points_to_adapt(tmp_path: Path) -> None:
    foreign = object.__new__(LoopConfig)  # what SFTConfig(...) is; built for real only where accelerate is installed
    with pytest.raises(trainer_ext.ConfigError, match=r"trainer_ext\.adapt\(ItsTrainer\)"):
        trainer_ext.Trainer(model=tiny_llama(), args=foreign)
    plain = object.__new__(transformers.TrainingArguments)
    with pytest.raises(trainer_ext.ConfigError, match="from trainer_ext import TrainingArguments"):
        trainer_ext.Trainer(model=tiny_llama(), args=plain)


def _as_stock(cls: type, **values: object) -> transformers.TrainingArguments:
    """A ``cls`` instance as its own ``__post_init__`` left it (built through the re-based class: transformers'
    stock set-up needs accelerate, absent here), not an instance of ours."""
    built = rebased_arguments_class(cls)(**values)
    stock = object.__new__(cls)
    stock.__dict__.update(built.__dict__)
    assert not isinstance(stock, trainer_ext.TrainingArguments)
    return stock


@dataclasses.dataclass
class DerivingConfig(transformers.TrainingArguments):
    """TRL's GRPOConfig pattern: two fields, either one given, the other derived; both given is refused."""

    generation_batch_size: int | None = None
    steps_per_generation: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError("'generation_batch_size' and 'steps_per_generation' can not be both configured")
        if self.generation_batch_size is None and self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if self.generation_batch_size is None:
            self.generation_batch_size = self.per_device_train_batch_size * self.steps_per_generation
        else:
            self.steps_per_generation = self.generation_batch_size // self.per_device_train_batch_size


@pytest.mark.parametrize("given", [{}, {"generation_batch_size": 16}, {"steps_per_generation": 3}])
def test_rebasing_a_config_whose_post_init_derives_a_field_it_refuses_to_be_given(tmp_path: Path, given: dict) -> None:
    stock = _as_stock(
        DerivingConfig, output_dir=str(tmp_path / "out"), report_to="none", per_device_train_batch_size=4, **given
    )
    rebased = rebase_arguments(stock)
    assert isinstance(rebased, trainer_ext.TrainingArguments) and isinstance(rebased, DerivingConfig)
    assert (rebased.generation_batch_size, rebased.steps_per_generation) == (
        stock.generation_batch_size,
        stock.steps_per_generation,
    )
    assert all(getattr(rebased, f.name) == getattr(stock, f.name) for f in dataclasses.fields(stock) if f.init)


def test_rebasing_still_refuses_what_the_config_refuses(tmp_path: Path) -> None:
    stock = _as_stock(LoopConfig, output_dir=str(tmp_path / "out"), report_to="none")
    stock.margin = -1.0  # changed after construction: the checks run again on rebasing
    with pytest.raises(ValueError, match="margin must not be negative"):
        rebase_arguments(stock)
