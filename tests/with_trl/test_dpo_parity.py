"""PreferenceTrainer (trainer_ext's engine, no accelerate) against TRL's stock trainers (accelerate underneath).

The same tiny Llama (saved once, loaded by each side), word-level chatml tokenizer and rows; fp32 on the CPU, the same
seed, batch, learning rate and constant schedule, dropout off. Compared: the tokenised datasets (ours
``encode_preference``, TRL's prepared ``train_dataset``) and the per-step logged losses and metrics over 4 steps.

- DPO ``sigmoid`` with a reference model, and ``ipo``: TRL's ``DPOTrainer`` on conversational rows.
- reference-free DPO (with and without label smoothing) and SimPO: TRL 1.16's ``DPOTrainer`` has no
  ``reference_free``; its ``CPOTrainer`` (``trl.experimental.cpo``) with ``cpo_alpha=0`` is reference-free DPO
  (``loss_type="sigmoid"``, conservative with ``label_smoothing``) and SimPO (``loss_type="simpo"``), on plain rows
  (CPO tokenizes strings: a tokenizer without bos gives DPO's tokens).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from tests.chat.test_preference import CONVERSATIONS, MAX_LEN, PLAIN, chat_tokenizer, tiny_model  # noqa: E402
from tests.helpers.jobs import make_args  # noqa: E402
from trainer_ext.chat.preference import encode_preference  # noqa: E402
from trainer_ext.chat.preference_trainer import PreferenceTrainer  # noqa: E402

STEPS = 4
LOSS_RTOL = 1e-6  # relative: an IPO loss is ~25
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
COMMON = dict(
    per_device_train_batch_size=4,
    max_steps=STEPS,
    learning_rate=2e-2,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
    disable_tqdm=True,
    use_cpu=True,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model(len(chat_tokenizer())).save_pretrained(path)
    return path


def _load(path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def _logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def _ours(out: Path, model_dir: Path, rows: list[dict], **options) -> tuple[Dataset, list[dict]]:
    tokenizer = chat_tokenizer()
    data = encode_preference(Dataset.from_list(rows), tokenizer, None, MAX_LEN, "rows")
    reference_free = options.get("reference_free") or options.get("loss_type") == "simpo"
    trainer = PreferenceTrainer(
        model=_load(model_dir),
        args=make_args(out, **COMMON),
        train_dataset=data,
        processing_class=tokenizer,
        ref_model=None if reference_free else _load(model_dir),
        **options,
    )
    trainer.train()
    return data, _logs(trainer)


def _trl_dpo(out: Path, model_dir: Path, rows: list[dict], loss_type: str) -> tuple[Dataset, list[dict]]:
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(out),
        beta=0.1,
        loss_type=loss_type,
        max_length=MAX_LEN,
        bf16=False,
        gradient_checkpointing=False,
        **COMMON,
    )
    trainer = DPOTrainer(
        model=_load(model_dir),
        ref_model=_load(model_dir),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=chat_tokenizer(),
    )
    prepared = trainer.train_dataset
    trainer.train()
    return prepared, _logs(trainer)


def _trl_cpo(out: Path, model_dir: Path, rows: list[dict], **options) -> tuple[Dataset, list[dict]]:
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = CPOConfig(
        output_dir=str(out),
        cpo_alpha=0.0,
        max_length=MAX_LEN,
        bf16=False,
        gradient_checkpointing=False,
        **options,
        **COMMON,
    )
    trainer = CPOTrainer(
        model=_load(model_dir), args=args, train_dataset=Dataset.from_list(rows), processing_class=chat_tokenizer()
    )
    prepared = trainer.train_dataset
    trainer.train()
    return prepared, _logs(trainer)


def _same_steps(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs) == STEPS
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), start=1):
        assert math.isclose(a["loss"], b["loss"], rel_tol=LOSS_RTOL), (step, a["loss"], b["loss"])
        for key in METRICS:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (step, key)
    assert ours[-1]["loss"] != ours[0]["loss"]  # it trained: the comparison is not of 4 identical steps


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_matches_trl(tmp_path: Path, model_dir: Path, loss_type: str) -> None:
    theirs_data, theirs = _trl_dpo(tmp_path / "trl", model_dir, CONVERSATIONS, loss_type)
    ours_data, ours = _ours(tmp_path / "ours", model_dir, CONVERSATIONS, loss_type=loss_type)
    assert ours_data["prompt_input_ids"] == theirs_data["prompt_ids"]
    assert ours_data["chosen_input_ids"] == theirs_data["chosen_ids"]
    assert ours_data["rejected_input_ids"] == theirs_data["rejected_ids"]
    _same_steps(ours, theirs)


def test_truncation_matches_trl(tmp_path: Path, model_dir: Path) -> None:
    """TRL keeps the whole pair in its dataset, drops prompts that fill max_length, and cuts in its collator
    (keep_start); ours cuts when encoding: the same tokens reach the model."""
    from trl import DPOConfig, DPOTrainer

    limit = 14
    args = DPOConfig(output_dir=str(tmp_path), max_length=limit, bf16=False, report_to="none", use_cpu=True)
    trl_data = DPOTrainer(
        model=_load(model_dir),
        ref_model=_load(model_dir),
        args=args,
        train_dataset=Dataset.from_list(CONVERSATIONS),
        processing_class=chat_tokenizer(),
    ).train_dataset
    ours = encode_preference(Dataset.from_list(CONVERSATIONS), chat_tokenizer(), None, limit, "rows")
    assert len(ours) == len(trl_data) < len(CONVERSATIONS)  # the system-prompt row is dropped by both
    cut = 0
    for mine, row in zip(ours, trl_data, strict=True):
        prompt = row["prompt_ids"]
        assert mine["prompt_input_ids"] == prompt
        for side in ("chosen", "rejected"):
            assert prompt + mine[f"{side}_input_ids"] == (prompt + row[f"{side}_ids"])[:limit]
        cut += len(prompt) + max(len(row["chosen_ids"]), len(row["rejected_ids"])) > limit
    assert cut > 0


@pytest.mark.parametrize(
    ("name", "ours_options", "cpo_options"),
    [
        ("reference-free", {"reference_free": True}, {"loss_type": "sigmoid", "beta": 0.1}),
        (
            "reference-free, label smoothing",
            {"reference_free": True, "label_smoothing": 0.1},
            {"loss_type": "sigmoid", "beta": 0.1, "label_smoothing": 0.1},
        ),
        ("simpo", {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5}, {"loss_type": "simpo", "beta": 2.0}),
    ],
)
def test_reference_free_and_simpo_match_trl_cpo(
    tmp_path: Path, model_dir: Path, name: str, ours_options: dict, cpo_options: dict
) -> None:
    theirs_data, theirs = _trl_cpo(tmp_path / "trl", model_dir, PLAIN, simpo_gamma=0.5, **cpo_options)
    ours_data, ours = _ours(tmp_path / "ours", model_dir, PLAIN, **ours_options)
    for mine, row in zip(ours_data, theirs_data, strict=True):
        assert mine["prompt_input_ids"] == row["prompt_input_ids"]
        assert mine["prompt_input_ids"] + mine["chosen_input_ids"] == row["chosen_input_ids"]
        assert mine["prompt_input_ids"] + mine["rejected_input_ids"] == row["rejected_input_ids"]
    _same_steps(ours, theirs)
