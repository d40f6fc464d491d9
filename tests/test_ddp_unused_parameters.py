"""DDP's ``find_unused_parameters`` for the built-in models: every parameter of every preset gets a gradient, so the
built-in jobs need no search for unused ones (whose warning every rank would otherwise print)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import run_ranks
from trainer_ext.job.arguments import PRESETS, TASKS, TrainJobArguments
from trainer_ext.job.run import build_model, build_tokenizer, label_names, load_raw_datasets, resolve_columns

WARNING = "find_unused_parameters=True was specified in DDP constructor"


# dpo builds sft's model (a causal LM from the same preset and chat tokenizer) and runs it on chosen and rejected rows
MODEL_TASKS = [task for task in TASKS if task != "dpo"]


@pytest.mark.parametrize("task", MODEL_TASKS)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_parameter_of_a_preset_gets_a_gradient(tmp_path: Path, task: str, preset: str) -> None:
    torch.manual_seed(0)
    args = TrainJobArguments(output_dir=str(tmp_path), task=task, model_config=preset, max_seq_length=32)
    raw = load_raw_datasets(args)
    if task == "sft":
        batch, model = _chat_batch(args, raw)
        model(**batch).loss.backward()
        unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert unused == [], f"{preset} for {task}: no gradient for {unused}"
        return
    text_column, label_column = resolve_columns(args, raw)
    labels = label_names(args, raw, label_column) if label_column else None
    tokenizer = build_tokenizer(args, raw["train"][text_column])
    model = build_model(args, tokenizer, labels)
    rows = raw["train"].select(range(8))
    texts = list(rows[text_column])
    batch = dict(tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt"))
    if labels:
        batch["labels"] = torch.tensor(
            [labels.index(v) if isinstance(v, str) else int(v) for v in list(rows[label_column])]
        )
    else:
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model(**batch).loss.backward()
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert unused == [], f"{preset} for {task}: no gradient for {unused}"


@pytest.mark.slow
def test_the_built_in_job_on_two_ranks_prints_no_find_unused_parameters_warning(tmp_path: Path) -> None:
    done = run_ranks("trainer_ext", 2, "train", "--max_steps", "3", "--output_dir", str(tmp_path / "out"))
    assert WARNING not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("task", TASKS)
def test_the_built_in_models_train_without_searching_for_unused_parameters(tmp_path: Path, task: str) -> None:
    assert TrainJobArguments(output_dir=str(tmp_path), task=task).ddp_find_unused_parameters is False


def _chat_batch(args: TrainJobArguments, raw) -> tuple[dict, torch.nn.Module]:
    """Eight of the shipped conversations as the sft job batches them, and the model it builds for them."""
    from trainer_ext.chat.packing import SFTCollator
    from trainer_ext.job.chat_job import build_chat_tokenizer, encode

    tokenizer, template, _ = build_chat_tokenizer(args, raw["train"])
    model = build_model(args, tokenizer, None)
    rows = encode(args, raw, tokenizer, template)["train"].select(range(8))
    return SFTCollator(pad_token_id=tokenizer.pad_token_id)(list(rows)), model
