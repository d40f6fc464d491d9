"""``trainer_ext.train`` end to end: tiny real runs that save, load back, resume, and refuse foreign runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
import transformers

from trainer_ext.errors import ConfigError
from trainer_ext.job.output_dir import RUN_FILE
from trainer_ext.job.run import train

EXAMPLES = Path(__file__).resolve().parents[1] / "configs" / "examples"
DATA = Path(__file__).resolve().parents[1] / "trainer_ext" / "job" / "builtin_data"


def tiny(out, **overrides):
    """A job that takes a few seconds: a few steps of a tiny model on a slice of the shipped data."""
    values = dict(
        output_dir=str(out),
        max_steps=3,
        max_train_samples=128,
        max_eval_samples=32,
        per_device_train_batch_size=16,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
    )
    values.update(overrides)
    return values


class Capture(transformers.TrainerCallback):
    """Keeps the trained model and tokenizer the Trainer hands to callbacks at the end of training."""

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        self.model, self.tokenizer = model, processing_class


@pytest.mark.timeout(120)
def test_classification_saves_a_model_that_loads_back_identically(tmp_path):
    out = tmp_path / "out"
    capture = Capture()
    metrics = train(tiny(out), callbacks=[capture])

    assert {"train_loss", "eval_loss", "eval_accuracy", "eval_baseline_accuracy"} <= metrics.keys()
    assert all(isinstance(v, float) for v in metrics.values())
    assert (out / "model.safetensors").is_file() and not (out / "pytorch_model.bin").exists()
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file() and (out / RUN_FILE).is_file()
    assert json.loads((out / "eval_results.json").read_text())["eval_loss"] == pytest.approx(metrics["eval_loss"])

    model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert model.config.id2label == {0: "negative", 1: "positive"}
    texts = ["the plot was not good .", "what a wonderful film !", "an unseen zebra word"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    assert (
        batch["input_ids"].tolist()
        == capture.tokenizer(texts, padding=True, return_tensors="pt")["input_ids"].tolist()
    )
    assert tokenizer.unk_token_id in batch["input_ids"][2].tolist()
    with torch.no_grad():
        capture.model.eval()
        assert torch.equal(model(**batch).logits, capture.model(**batch).logits)


@pytest.mark.timeout(120)
def test_causal_lm_from_flags(tmp_path):
    out = tmp_path / "out"
    metrics = train(
        [
            "--task",
            "causal-lm",
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--max_train_samples",
            "200",
            "--max_eval_samples",
            "40",
            "--max_seq_length",
            "64",
            "--disable_tqdm",
            "true",
        ]
    )
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tokenizer)
    ids = tokenizer("anna has", return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tokenizer.bos_token_id and ids[0, -1].item() == tokenizer.eos_token_id
    generated = model.generate(ids[:, :-1], max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] == ids.shape[1] - 1 + 3


@pytest.mark.timeout(120)
def test_own_csv_with_integer_classes_and_inferred_columns(tmp_path):
    rows = ["review,stars"] + [f"review number {i} says {'bad ok great'.split()[i % 3]},{i % 3}" for i in range(60)]
    data = tmp_path / "reviews.csv"
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    metrics = train(tiny(out, train_file=str(data), label_column="stars", max_train_samples=None))
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.num_labels == 3 and config.id2label == {0: "0", 1: "1", 2: "2"}
    assert metrics["eval_samples"] == 6.0  # 10% of 60 held out
    run = json.loads((out / RUN_FILE).read_text())["job"]
    assert (run["text_column"], run["label_column"]) == ("review", "stars")


@pytest.mark.timeout(180)
def test_resume_needs_to_be_asked_for(tmp_path):
    out = tmp_path / "out"
    train(tiny(out, max_steps=2, save_strategy="steps", save_steps=2))
    assert (out / "checkpoint-2").is_dir()
    with pytest.raises(ConfigError, match="holds checkpoints of this job"):
        train(tiny(out, max_steps=4, save_strategy="steps", save_steps=2))
    train(tiny(out, max_steps=4, save_strategy="steps", save_steps=2, resume_from_checkpoint="true"))
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and (out / "checkpoint-4").is_dir() and (out / "checkpoint-2").is_dir()


@pytest.mark.timeout(180)
def test_another_job_is_refused_until_overwrite(tmp_path):
    out = tmp_path / "out"
    train(tiny(out, max_steps=2, save_strategy="steps", save_steps=2))
    other = tiny(out, task="causal-lm", max_steps=2, save_strategy="steps", save_steps=1)
    with pytest.raises(ConfigError, match=r"different job \(task: 'sequence-classification' -> 'causal-lm'"):
        train(other)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    train({**other, "overwrite_output_dir": True})
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert transformers.AutoConfig.from_pretrained(out / "checkpoint-2").model_type == "llama"
    assert json.loads((out / RUN_FILE).read_text())["job"]["task"] == "causal-lm"
    assert transformers.AutoConfig.from_pretrained(out).model_type == "llama"


def test_same_job_without_checkpoints_runs_again(tmp_path):
    out = tmp_path / "out"
    first = train(tiny(out, max_steps=1))
    again = train(tiny(out, max_steps=1))
    assert again["eval_loss"] == pytest.approx(first["eval_loss"], abs=1e-6)  # seeded: the same run again


def test_missing_column_is_reported_before_writing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="its columns: label, text"):
        train(tiny(out, text_column="sentence"))
    assert not out.exists()


def run_cli(*argv, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "trainer_ext", "train", *argv], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_default_job_learns(tmp_path):
    out = tmp_path / "default"
    proc = run_cli("--output_dir", str(out), "--disable_tqdm", "true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "all_results.json").read_text())
    assert metrics["eval_accuracy"] >= 0.9 > metrics["eval_baseline_accuracy"] + 0.3
    assert metrics["eval_loss"] < 0.35 < math.log(2)
    assert "eval_accuracy" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_causal_lm_example_learns(tmp_path):
    out = tmp_path / "clm"
    proc = run_cli("--config", str(EXAMPLES / "causal_lm.yaml"), "--output_dir", str(out), "--disable_tqdm", "true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "all_results.json").read_text())
    vocab = transformers.AutoConfig.from_pretrained(out).vocab_size
    assert metrics["eval_perplexity"] < 4 < vocab / 10


def test_classification_loss_is_a_mean_under_gradient_accumulation(tmp_path):
    """With 2 micro-batches the logged loss of an untrained 2-class model is ~ln 2, not 2 ln 2."""
    metrics = train(
        tiny(tmp_path, gradient_accumulation_steps=2, max_steps=1, learning_rate=1e-12, per_device_train_batch_size=8)
    )
    assert abs(metrics["train_loss"] - math.log(2)) < 0.15


def test_overwrite_with_a_resume_path_is_refused_and_keeps_the_checkpoint(tmp_path):
    out = tmp_path / "out"
    train(tiny(out, max_steps=2, save_strategy="steps", save_steps=2))
    with pytest.raises(ConfigError, match="pass one of the two"):
        train(tiny(out, max_steps=4, overwrite_output_dir=True, resume_from_checkpoint=str(out / "checkpoint-2")))
    assert (out / "checkpoint-2" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"optim": "adamw_bnb_8bit"}, "bitsandbytes"),
        ({"lr_scheduler_type": "cosine_with_restarts", "lr_scheduler_kwargs": {"no_such_arg": 1}}, "no_such_arg"),
    ],
)
def test_settings_that_fail_late_are_refused_before_writing(tmp_path, overrides, match):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=match):
        train(tiny(out, **overrides))
    assert not out.exists() or not any(out.iterdir())


def test_too_few_rows_to_hold_out_is_a_clear_error(tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text('{"text": "good film", "label": "positive"}\n')
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="cannot hold out"):
        train(tiny(out, train_file=str(data)))
    assert not out.exists()


def _rows(name: str, limit: int) -> list[dict]:
    """The first ``limit`` rows of a data file shipped with trainer_ext."""
    lines = (DATA / name).read_text().splitlines()[:limit]
    return [json.loads(line) for line in lines]


def assert_reloads_as_trained(out: Path, capture: Capture, auto: type, texts: list[str]) -> None:
    """The saved model and tokenizer load back: the trained weights bit for bit, the same tokens and logits."""
    model = auto.from_pretrained(out).eval()
    trained = capture.model.eval()
    saved, kept = model.state_dict(), trained.state_dict()
    assert saved.keys() == kept.keys()
    for name, value in saved.items():
        assert torch.equal(value, kept[name]), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    assert (
        batch["input_ids"].tolist()
        == capture.tokenizer(texts, padding=True, return_tensors="pt")["input_ids"].tolist()
    )
    with torch.no_grad():  # same weights; the kernels may still round differently (memory layout), hence a tolerance
        torch.testing.assert_close(model(**batch).logits, trained(**batch).logits, atol=1e-6, rtol=0)


@pytest.mark.timeout(120)
def test_json_array_file_trains_a_classifier(tmp_path):
    """A .json file holding one JSON array (not JSON lines)."""
    data = tmp_path / "reviews.json"
    data.write_text(json.dumps(_rows("sentiment.jsonl", 80), indent=1))
    assert data.read_text().startswith("[")
    out, capture = tmp_path / "out", Capture()
    metrics = train(tiny(out, train_file=str(data), max_train_samples=None), callbacks=[capture])
    assert metrics["train_samples"] == 72.0 and metrics["eval_samples"] == 8.0  # 10% held out
    assert {"train_loss", "eval_loss", "eval_accuracy"} <= metrics.keys()
    assert math.isfinite(metrics["eval_loss"])
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.id2label == {0: "negative", 1: "positive"}
    assert_reloads_as_trained(out, capture, transformers.AutoModelForSequenceClassification, ["a clever film ."])


@pytest.mark.timeout(120)
def test_text_file_trains_a_causal_lm(tmp_path):
    """A .txt file, one text per line, cut into blocks of --max_seq_length tokens."""
    data = tmp_path / "stories.txt"
    data.write_text("\n".join(row["text"] for row in _rows("corpus.jsonl", 120)) + "\n")
    out, capture = tmp_path / "out", Capture()
    metrics = train(
        tiny(out, task="causal-lm", train_file=str(data), max_train_samples=None, max_seq_length=32),
        callbacks=[capture],
    )
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert metrics["train_samples"] > 16, "the text must make several blocks of 32 tokens"
    assert transformers.AutoConfig.from_pretrained(out).model_type == "llama"
    assert_reloads_as_trained(out, capture, transformers.AutoModelForCausalLM, ["cleo has nine plums ."])


@pytest.mark.timeout(120)
def test_parquet_files_with_a_validation_file(tmp_path):
    """Parquet train and validation files: all train rows train, the validation file is what is evaluated."""
    rows = _rows("sentiment.jsonl", 60)
    datasets.Dataset.from_list(rows[:48]).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(rows[48:]).to_parquet(str(tmp_path / "valid.parquet"))
    out, capture = tmp_path / "out", Capture()
    metrics = train(
        tiny(
            out,
            train_file=str(tmp_path / "train.parquet"),
            validation_file=str(tmp_path / "valid.parquet"),
            max_train_samples=None,
        ),
        callbacks=[capture],
    )
    assert metrics["train_samples"] == 48.0 and metrics["eval_samples"] == 12.0  # nothing held out of train
    assert {"eval_loss", "eval_accuracy", "eval_baseline_accuracy"} <= metrics.keys()
    assert json.loads((out / "eval_results.json").read_text())["eval_samples"] == 12
    assert_reloads_as_trained(out, capture, transformers.AutoModelForSequenceClassification, ["the plot was slow ."])


def _save_pretrained_llama(path: Path) -> transformers.PreTrainedTokenizerFast:
    """A tiny Llama and a word-level tokenizer over the shipped corpus, saved the way the hub stores them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    texts = [row["text"] for row in _rows("corpus.jsonl", 400)]
    backend.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials, show_progress=False))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(123)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


@pytest.mark.timeout(120)
def test_fine_tunes_a_pretrained_model_from_a_directory(tmp_path):
    """--model_name_or_path DIR: its weights and tokenizer are the start point (not a model built from scratch)."""
    base = tmp_path / "base"
    tokenizer = _save_pretrained_llama(base)
    out, capture = tmp_path / "out", Capture()
    metrics = train(
        tiny(out, task="causal-lm", model_name_or_path=str(base), max_seq_length=32, max_train_samples=64),
        callbacks=[capture],
    )
    assert math.isfinite(metrics["eval_loss"]) and "eval_perplexity" in metrics
    assert transformers.AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()
    start = transformers.AutoModelForCausalLM.from_pretrained(base).state_dict()
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert tuned.keys() == start.keys()
    moved = max(float((tuned[k] - start[k]).abs().max()) for k in start)
    assert 0 < moved < 1e-2, f"3 steps at lr 5e-5 from the saved weights, not from a fresh init (moved {moved})"
    assert_reloads_as_trained(out, capture, transformers.AutoModelForCausalLM, ["cleo has nine plums ."])
