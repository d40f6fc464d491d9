"""``trainer_ext.Seq2SeqTrainer`` and ``Seq2SeqTrainingArguments``: transformers' seq2seq classes on our engine,
usable where accelerate is not installed (transformers' own arguments class then cannot be built)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
import transformers
from transformers import HfArgumentParser

import trainer_ext
from tests.helpers.ranks import run_ranks
from tests.helpers.tiny import copy_rows, tiny_t5


def test_the_arguments_are_transformers_seq2seq_arguments_on_ours(tmp_path):
    args = trainer_ext.Seq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert isinstance(args, transformers.Seq2SeqTrainingArguments)
    assert isinstance(args, trainer_ext.TrainingArguments)
    # transformers' seq2seq defaults, and ours beside them
    assert (args.predict_with_generate, args.generation_max_length, args.generation_num_beams) == (False, None, None)
    assert args.save_final_model is False and args.device.type == "cpu"
    restored = pickle.loads(pickle.dumps(args))
    assert type(restored) is type(args) and restored.to_dict() == args.to_dict()


def test_hf_argument_parser_reads_the_seq2seq_flags(tmp_path):
    argv = ["--output_dir", str(tmp_path), "--predict_with_generate", "--generation_num_beams", "3", "--use_cpu"]
    (args,) = HfArgumentParser(trainer_ext.Seq2SeqTrainingArguments).parse_args_into_dataclasses(argv)
    assert args.predict_with_generate is True and args.generation_num_beams == 3


def test_the_trainer_is_adapt_of_transformers_seq2seq_trainer():
    assert trainer_ext.adapt(transformers.Seq2SeqTrainer) is trainer_ext.Seq2SeqTrainer
    assert issubclass(trainer_ext.Seq2SeqTrainer, transformers.Seq2SeqTrainer)
    assert issubclass(trainer_ext.Seq2SeqTrainer, trainer_ext.Trainer)


def test_evaluation_generates_and_training_learns(tmp_path):
    args = trainer_ext.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        max_steps=30,
        logging_steps=1,
        save_strategy="no",
        predict_with_generate=True,
        generation_max_length=7,
    )
    trainer = trainer_ext.Seq2SeqTrainer(
        model=tiny_t5(), args=args, train_dataset=copy_rows(16, 0), eval_dataset=copy_rows(6, 1)
    )
    assert type(trainer.accelerator).__module__.startswith("trainer_ext")
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < 0.8 * losses[0]
    output = trainer.predict(copy_rows(6, 1))
    # generated token ids: the trained model's own greedy generate() to generation_max_length, which transformers'
    # Seq2SeqTrainer then pads (pad id 0) to the model's generation_config.max_length (20)
    assert output.predictions.shape == (6, 20) and output.predictions.dtype.kind == "i"
    with torch.no_grad():
        direct = trainer.model.generate(input_ids=torch.tensor(copy_rows(6, 1)["input_ids"]), max_length=7).numpy()
    width = direct.shape[1]
    assert (output.predictions[:, :width] == direct).all() and (output.predictions[:, width:] == 0).all()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_generate_and_train_like_one(tmp_path):
    flags = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]
    flags += ["--max_steps", "3", "--learning_rate", "3e-3", "--logging_steps", "1", "--predict_with_generate"]
    flags += ["--generation_max_length", "8", "--per_device_eval_batch_size", "2", "--seed", "7"]
    results = {}
    for nproc in (1, 2):
        out = tmp_path / str(nproc)
        batch = ["--per_device_train_batch_size", str(4 // nproc)]
        run_ranks("tests.helpers.seq2seq_job", nproc, str(out), "--output_dir", str(out), *flags, *batch)
        results[nproc] = json.loads((out / "result.json").read_text())
    one, two = results[1], results[2]
    assert (one["world_size"], two["world_size"]) == (1, 2) and two["engine"].startswith("trainer_ext")
    assert "trainer_ext.trainer.training_args.TrainingArguments" in two["args_mro"]
    assert two["before"] == one["before"]  # the same model generates the same ids, gathered in the same order
    assert two["after_shape"] == one["after_shape"] == [8, 20]
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    assert two["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
