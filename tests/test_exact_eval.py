"""Exact eval loss (``exact_eval_loss``): one number for any world size, batch size and dataset kind.

The reference is computed here directly from the model: the token-averaged next-token loss of the whole eval set,
and the sample-averaged classification loss. Eval sizes are prime, so 2 and 3 processes always leave an uneven last
round, whose repeated samples must count neither in the loss nor in the metrics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2ForSequenceClassification,
    LlamaForSequenceClassification,
)

from tests.helpers import exact_eval_job, masked_tail_eval_job
from tests.helpers.jobs import make_args
from tests.helpers.ranks import run_ranks
from tests.helpers.tiny import pad_right, ragged_lm_dataset, tiny_llama, tiny_t5
from trainer_ext import Trainer, TrainingArguments
from trainer_ext.job.arguments import TrainJobArguments
from trainer_ext.trainer.compat import loss_shifts_labels
from trainer_ext.trainer.exact_eval import batch_rows, first_rows, loss_units

SIZE = 13  # prime: uneven on 2 and 3 processes for every batch size
TOL = 2e-6  # relative: sums of fp32 per-batch means in another order


def reference_lm_loss() -> tuple[float, int]:
    """(token-mean next-token loss over the whole set, number of predicted tokens), one sequence at a time."""
    model = tiny_llama(2).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in ragged_lm_dataset(SIZE, seed=7):
            ids = torch.tensor([row["input_ids"]])
            logits = model(input_ids=ids).logits[0, :-1].double()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:].long(), reduction="sum").item()
            tokens += ids.shape[1] - 1
    return total / tokens, tokens


def reference_classification_loss() -> float:
    config = tiny_llama(2).config
    config.num_labels = 2
    torch.manual_seed(3)
    model = LlamaForSequenceClassification(config).eval()
    losses = []
    with torch.no_grad():
        for row in ragged_lm_dataset(SIZE, seed=7):
            ids = torch.tensor([row["input_ids"]])
            label = torch.tensor([len(row["input_ids"]) % 2])
            losses.append(model(input_ids=ids, labels=label).loss.item())
    return sum(losses) / len(losses)


@pytest.fixture(scope="module")
def references() -> dict[str, float]:
    lm, tokens = reference_lm_loss()
    return {"lm": lm, "tokens": tokens, "classify": reference_classification_loss()}


def test_loss_units_follow_transformers_loss_definitions() -> None:
    labels = torch.tensor([[5, 6, -100], [7, -100, -100]])
    assert int(loss_units({"labels": labels}, shifts_labels=False)) == 3  # token classification, seq2seq
    assert int(loss_units({"labels": labels}, shifts_labels=True)) == 1  # causal LM: labels[..., 1:]
    shift = torch.tensor([[6, -100, -100], [-100, -100, -100]])
    assert int(loss_units({"labels": labels, "shift_labels": shift}, shifts_labels=True)) == 1
    assert int(loss_units({"labels": torch.tensor([0, 1, -100])}, shifts_labels=False)) == 2  # classification
    assert int(loss_units({"labels": torch.zeros(4, 3)}, shifts_labels=False)) == 12  # multi-label / regression
    qa = {"input_ids": torch.zeros(5, 7), "start_positions": torch.zeros(5), "end_positions": torch.zeros(5)}
    assert loss_units(qa, shifts_labels=False) == 5  # a loss from other keys: samples


def test_first_rows_cuts_every_per_sample_value() -> None:
    batch = {"input_ids": torch.arange(12).view(4, 3), "ids": ["a", "b", "c", "d"], "scale": torch.tensor(2.0)}
    assert batch_rows(batch) == 4
    part = first_rows(batch, 4, 2)
    assert part["input_ids"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert part["ids"] == ["a", "b"] and part["scale"].item() == 2.0


def test_exact_eval_loss_is_off_for_a_plain_trainer_and_on_for_train_jobs(tmp_path: Path) -> None:
    assert TrainingArguments(output_dir=str(tmp_path), use_cpu=True).exact_eval_loss is False
    field = TrainJobArguments.__dataclass_fields__["exact_eval_loss"]
    assert field.default is True


def _evaluate(out: Path, batch: int, exact: bool) -> dict:
    trainer = Trainer(
        model=tiny_llama(2),
        args=make_args(out, per_device_eval_batch_size=batch, exact_eval_loss=exact),
        eval_dataset=ragged_lm_dataset(SIZE, seed=7),
        data_collator=pad_right,
    )
    return trainer.evaluate()


@pytest.mark.compat  # the loss transformers divides by num_items_in_batch is undone the same way on 5.17
def test_transformers_figure_is_kept_under_another_name(tmp_path: Path, references: dict) -> None:
    stock = _evaluate(tmp_path / "stock", 3, exact=False)
    exact = _evaluate(tmp_path / "exact", 3, exact=True)
    assert "eval_batch_mean_loss" not in stock  # drop-in: a plain Trainer logs what transformers logs
    assert exact["eval_batch_mean_loss"] == pytest.approx(stock["eval_loss"], rel=1e-7)
    assert exact["eval_loss"] == pytest.approx(references["lm"], rel=TOL)
    assert abs(stock["eval_loss"] - references["lm"]) > 1e-4  # the per-batch mean really differs here


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The job on 1, 2 and 3 processes: 3 dataset kinds x batch sizes 1, 3, 8 x streamed/classic metrics."""
    results = {}
    for nproc in (1, 2, 3):
        out = tmp_path_factory.mktemp(f"exact_eval_{nproc}")
        run_ranks(exact_eval_job, nproc, str(out), str(SIZE))
        results[nproc] = json.loads((out / "results.json").read_text())
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_one_eval_loss_for_every_world_size_batch_size_and_dataset_kind(
    runs: dict[int, dict], references: dict, nproc: int
) -> None:
    lm = {key: value for key, value in runs[nproc].items() if key.startswith(exact_eval_job.KINDS)}
    assert len(lm) == len(exact_eval_job.KINDS) * len(exact_eval_job.BATCH_SIZES) * 2
    for key, metrics in lm.items():
        assert metrics["eval_loss"] == pytest.approx(references["lm"], rel=TOL), key
    spread = [metrics["eval_batch_mean_loss"] for metrics in lm.values()]
    if nproc > 1:
        assert max(spread) - min(spread) > 1e-3  # transformers' own figure does move with the batching


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_repeated_samples_never_reach_the_metrics(runs: dict[int, dict], references: dict, nproc: int) -> None:
    for key, metrics in runs[nproc].items():
        if key.endswith("-classic"):
            assert (metrics["eval_samples"], metrics["eval_tokens"]) == (SIZE, references["tokens"]), key
        elif key.endswith("-streamed"):
            assert math.log(metrics["eval_perplexity"]) == pytest.approx(references["lm"], rel=TOL), key


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_a_per_sample_loss_is_averaged_over_samples(runs: dict[int, dict], references: dict, nproc: int) -> None:
    for batch in exact_eval_job.BATCH_SIZES:
        assert runs[nproc][f"classify-{batch}"]["eval_loss"] == pytest.approx(references["classify"], rel=TOL)


def _sharded(tmp_path: Path, strategy: str, nproc: int) -> dict:
    run_ranks(exact_eval_job, nproc, str(tmp_path), str(SIZE), strategy)
    return json.loads((tmp_path / "results.json").read_text())


@pytest.mark.distributed
def test_fsdp2_evaluation_is_exact_too(tmp_path: Path, references: dict) -> None:
    """The extra forward pass over a mixed last batch runs on every rank: FSDP's all-gathers stay in step."""
    for key, metrics in _sharded(tmp_path, "fsdp", 3).items():
        assert metrics["eval_loss"] == pytest.approx(references["lm"], rel=TOL), key


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_zero3_evaluation_without_training_is_exact_too(tmp_path: Path, references: dict) -> None:
    """Also: evaluating before any training under ZeRO-3 with the shipped preset (its 'auto' values)."""
    for key, metrics in _sharded(tmp_path, "zero3", 3).items():
        assert metrics["eval_loss"] == pytest.approx(references["lm"], rel=TOL), key


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_full_predictions_still_work_for_those_who_want_them(
    runs: dict[int, dict], references: dict, nproc: int
) -> None:
    """eval_accumulation_steps and eval_do_concat_batches keep transformers' meaning next to the exact loss."""
    found = runs[nproc]["predict"]
    assert found["rows"] == SIZE
    assert found["accumulated_equal"] and found["batches_equal"]
    assert found["batches"] == -(-SIZE // (3 * nproc))  # one gathered array per round of the ranks
    for key in ("loss", "accumulated_loss"):
        assert found[key] == pytest.approx(references["lm"], rel=TOL)


def test_which_losses_shift_the_labels() -> None:
    """GPT-2's head names no loss type (transformers' own count then misses the shift), yet its loss is causal."""
    gpt2 = masked_tail_eval_job.tiny_gpt2()
    assert gpt2.loss_type is None  # why transformers' _loss_shifts_labels is False for it
    assert loss_shifts_labels(gpt2) and loss_shifts_labels(tiny_llama(2))
    assert not loss_shifts_labels(tiny_t5())  # encoder-decoder: its labels are the decoder's own targets
    bert = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    assert not loss_shifts_labels(BertForMaskedLM(bert))
    assert not loss_shifts_labels(BertForSequenceClassification(bert))
    assert not loss_shifts_labels(GPT2ForSequenceClassification(gpt2.config))
    assert not loss_shifts_labels(torch.nn.Linear(2, 2))  # not a transformers model: no loss of its own


@pytest.fixture(scope="module")
def masked_tail_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The tiny GPT-2 on full-length rows with masked tails, on 1 and 2 processes, at several batch sizes."""
    results = {}
    for nproc in (1, 2):
        out = tmp_path_factory.mktemp(f"masked_tail_{nproc}")
        run_ranks(masked_tail_eval_job, nproc, str(out))
        results[nproc] = json.loads((out / "results.json").read_text())
    return results


@pytest.mark.distributed
def test_gpt2_masked_tails_give_one_loss_on_2_processes_and_1(masked_tail_runs: dict[int, dict]) -> None:
    """A mixed last batch is re-run without num_items_in_batch: its mean is over the shifted labels."""
    reference = masked_tail_eval_job.reference_loss()
    single = {batch: found["loss"] for batch, found in masked_tail_runs[1].items()}
    double = {batch: found["loss"] for batch, found in masked_tail_runs[2].items()}
    assert sorted(single, key=int) == [str(batch) for batch in masked_tail_eval_job.BATCH_SIZES]
    assert double == pytest.approx(single, rel=TOL)
    assert single == pytest.approx(dict.fromkeys(single, reference), rel=TOL)
