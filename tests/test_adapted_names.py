"""Classes made by ``trainer_ext.adapt`` carry trainer_ext's names, and still copy, pickle and parse as before."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path
from typing import Literal

import transformers
from transformers import HfArgumentParser

import trainer_ext
from trainer_ext.trainer.adapt import rebase_arguments, rebased_arguments_class

Mode = Literal["fast", "careful"]  # named only here: the re-based class must resolve it where it was written


@dataclasses.dataclass
class ModeConfig(transformers.TrainingArguments):
    mode: Mode = "fast"
    margin: float = 0.5


class ModeTrainer(transformers.Trainer):
    pass


def test_exported_classes_print_and_pickle_as_trainer_ext_names() -> None:
    for name in ("Seq2SeqTrainer", "Seq2SeqTrainingArguments"):
        cls = getattr(trainer_ext, name)
        assert repr(cls) == f"<class 'trainer_ext.{name}'>"
        assert pickle.loads(pickle.dumps(cls)) is cls  # found again by its name
    assert trainer_ext.adapt(transformers.Seq2SeqTrainer) is trainer_ext.Seq2SeqTrainer
    stock = rebased_arguments_class(transformers.Seq2SeqTrainingArguments)
    assert stock is trainer_ext.Seq2SeqTrainingArguments


def test_other_adapted_classes_are_named_in_adapt() -> None:
    trainer_cls, args_cls = trainer_ext.adapt(ModeTrainer), rebased_arguments_class(ModeConfig)
    assert repr(trainer_cls) == "<class 'trainer_ext.trainer.adapt.ModeTrainer'>"
    assert repr(args_cls) == "<class 'trainer_ext.trainer.adapt.ModeConfig'>"
    assert trainer_cls.__name__ == "ModeTrainer" and args_cls.__name__ == "ModeConfig"
    assert trainer_cls._trainer_ext_adapted_from is ModeTrainer and args_cls._trainer_ext_rebased_from is ModeConfig


def test_rebased_arguments_copy_and_pickle_as_transformers_and_trl_do(tmp_path: Path) -> None:
    """transformers deep-copies and pickles its arguments (training_args.bin); TRL copies and replaces them."""
    args = rebased_arguments_class(ModeConfig)(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", mode="careful"
    )
    assert rebase_arguments(args) is args
    for other in (copy.copy(args), copy.deepcopy(args), pickle.loads(pickle.dumps(args))):
        assert type(other) is type(args) and other.to_dict() == args.to_dict()
    replaced = dataclasses.replace(args, margin=0.25)
    assert type(replaced) is type(args) and (replaced.margin, replaced.mode) == (0.25, "careful")
    seq2seq = trainer_ext.Seq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert type(copy.deepcopy(seq2seq)) is trainer_ext.Seq2SeqTrainingArguments


def test_the_argument_parser_reads_fields_annotated_where_the_config_was_written(tmp_path: Path) -> None:
    """``from __future__ import annotations`` makes every annotation a string, resolved in the config's module."""
    parser = HfArgumentParser(rebased_arguments_class(ModeConfig))
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--mode", "careful", "--use_cpu"])
    assert args.mode == "careful" and isinstance(args, ModeConfig) and isinstance(args, trainer_ext.TrainingArguments)
