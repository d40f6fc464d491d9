"""TrainJobArguments: automatic defaults, user precedence, and every cheap validation (no training here)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers

from trainer_ext.errors import ConfigError
from trainer_ext.job.arguments import (
    AUTO_DEFAULTS,
    PRESETS,
    TrainJobArguments,
    field_names,
    job_arguments_from_dict,
    looks_local,
)
from trainer_ext.job.builtin_data import CORPUS, SENTIMENT, make_dataset


def test_builtin_job_defaults():
    args = TrainJobArguments()
    assert args.task == "sequence-classification"
    assert args.output_dir == "outputs/default"
    assert args.train_file == str(SENTIMENT)
    assert args.learning_rate == AUTO_DEFAULTS["scratch"]["learning_rate"]
    assert args.per_device_train_batch_size == 32
    assert args.num_train_epochs == 3.0
    assert args.save_strategy == "no"
    assert args.report_to == []


def test_builtin_causal_lm_defaults():
    args = TrainJobArguments(task="causal_lm")
    assert args.task == "causal-lm"
    assert args.output_dir == "outputs/default-causal-lm"
    assert args.train_file == str(CORPUS)
    assert args.num_train_epochs == 10.0


def test_user_values_beat_automatic_defaults(tmp_path):
    args = TrainJobArguments(learning_rate=1e-4, save_strategy="epoch", num_train_epochs=1, output_dir=str(tmp_path))
    assert (args.learning_rate, args.save_strategy, args.num_train_epochs) == (1e-4, "epoch", 1)
    assert args.output_dir == str(tmp_path)
    assert {"learning_rate", "save_strategy", "num_train_epochs", "output_dir"}.isdisjoint(args.auto_filled)
    assert args.auto_filled["per_device_train_batch_size"] == 32


def test_pretrained_model_gets_transformers_defaults(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    args = TrainJobArguments(model_name_or_path=str(model_dir))
    assert not args.from_scratch
    assert args.learning_rate == 5e-5 and args.per_device_train_batch_size == 8
    assert args.save_strategy == "steps" and args.output_dir == "trainer_output"


def test_own_data_is_not_the_builtin_job(tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("text,label\na,0\n")
    args = TrainJobArguments(train_file=str(data))
    assert args.output_dir == "trainer_output" and args.save_strategy == "steps"
    assert args.learning_rate == 2e-3  # still a model from scratch


def test_every_training_arguments_field_is_a_job_field():
    hf_fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    assert hf_fields <= set(field_names())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(task="clasification"), "Did you mean 'sequence-classification'"),
        (dict(model_config="tiny-bret"), "Did you mean 'tiny-bert'"),
        (dict(model_name_or_path="./no/such/model"), "no such file or directory"),
        (dict(tokenizer_name="/no/such/tokenizer"), "no such file or directory"),
        (dict(model_config="configs/missing.json"), "no such file or directory"),
        (dict(train_file="missing.jsonl"), "no such file"),
        (dict(train_file="data.xlsx"), "unsupported file type '.xlsx'"),
        (dict(validation_file=str(SENTIMENT)), "needs --train_file"),
        (dict(train_file=str(SENTIMENT), dataset_name="imdb"), "one source"),
        (dict(validation_split_percentage=100), "validation_split_percentage"),
        (dict(max_seq_length=1), "max_seq_length"),
        (dict(num_labels=0), "num_labels"),
        (dict(max_train_samples=0), "max_train_samples"),
        (dict(fp16=True), "fp16"),
    ],
)
def test_bad_input_raises_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        TrainJobArguments(**kwargs)


def test_model_and_config_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="not both"):
        TrainJobArguments(model_name_or_path=str(tmp_path), model_config="tiny-bert")


def test_train_and_validation_files_must_share_a_format(tmp_path):
    csv, jsonl = tmp_path / "a.csv", tmp_path / "b.jsonl"
    csv.write_text("text,label\na,0\n")
    jsonl.write_text('{"text": "a", "label": 0}\n')
    with pytest.raises(ConfigError, match="same format"):
        TrainJobArguments(train_file=str(csv), validation_file=str(jsonl))


def test_hub_ids_are_not_checked_as_paths():
    assert not looks_local("bert-base-uncased") and not looks_local("org/model-name")
    assert looks_local("./model") and looks_local("/abs/model") and looks_local("a/b/c") and looks_local("x.json")
    assert TrainJobArguments(model_name_or_path="org/some-model").model_name_or_path == "org/some-model"


def test_presets_cover_both_tasks():
    args = TrainJobArguments(model_config="tiny-gpt2", task="causal-lm")
    assert args.model_config in PRESETS and args.from_scratch


def test_from_dict_accepts_dashes_and_names_unknown_keys():
    args = job_arguments_from_dict({"learning-rate": 3e-4, "max_steps": 2})
    assert args.learning_rate == 3e-4 and args.max_steps == 2
    with pytest.raises(ConfigError, match="unknown key 'learning_rat'.*Did you mean 'learning_rate'"):
        job_arguments_from_dict({"learning_rat": 3e-4})


def test_fingerprint_identifies_model_and_data(tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "a", "label": 0}\n')
    base = TrainJobArguments(output_dir=str(tmp_path))
    assert base.fingerprint() == TrainJobArguments(output_dir=str(tmp_path), learning_rate=1e-4).fingerprint()
    assert base.fingerprint() != TrainJobArguments(output_dir=str(tmp_path), train_file=str(other)).fingerprint()
    assert base.fingerprint() != TrainJobArguments(output_dir=str(tmp_path), model_config="tiny-gpt2").fingerprint()
    json.dumps(base.fingerprint())  # it is stored as JSON


def test_shipped_data_is_reproducible_and_small(tmp_path):
    for path in make_dataset.write_all(tmp_path):
        shipped = SENTIMENT.parent / path.name
        assert path.read_bytes() == shipped.read_bytes(), f"{shipped} differs from its generator"
        assert shipped.stat().st_size < 1_000_000
    rows = [json.loads(line) for line in SENTIMENT.read_text().splitlines()]
    share = sum(r["label"] == "positive" for r in rows) / len(rows)
    assert len(rows) == 4000 and 0.45 < share < 0.55
    assert len({r["text"] for r in rows}) == len(rows)
