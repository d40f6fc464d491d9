"""trainer_ext.chat.packing against TRL's SFTTrainer(packing=True): the same blocks, batches and losses.

TRL's prepared dataset (``packing_strategy="bfd"``) and its padding-free collator are compared with ``pack_examples``
and ``SFTCollator`` on the same tokenised rows (TRL's own tokenisation of text rows, and pre-tokenised rows with
masked prompts).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("trl")

import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from tests.with_trl.trl_job import dataset, tokenizer  # noqa: E402
from trainer_ext.chat.packing import IGNORE_INDEX, SFTCollator, pack_examples  # noqa: E402

MAX_LENGTH = 24


def _model(vocab: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
    )
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def _trl(tmp_path, rows: Dataset, packing: bool, **config) -> SFTTrainer:
    tok = tokenizer()
    args = SFTConfig(
        output_dir=str(tmp_path),
        packing=packing,
        max_length=MAX_LENGTH,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        **config,
    )
    return SFTTrainer(model=_model(len(tok)), args=args, train_dataset=rows, processing_class=tok)


def _pretokenised(n: int = 40) -> Dataset:
    rng = random.Random(3)
    input_ids, labels = [], []
    for _ in range(n):
        ids = [rng.randrange(4, 30) for _ in range(rng.randint(2, MAX_LENGTH))]
        prompt = rng.randint(0, len(ids) - 1)
        input_ids.append(ids)
        labels.append([IGNORE_INDEX] * prompt + ids[prompt:])
    return Dataset.from_dict({"input_ids": input_ids, "labels": labels})


def _assert_same_blocks(trl_packed: Dataset, ours: Dataset) -> None:
    assert trl_packed["input_ids"] == ours["input_ids"]
    assert trl_packed["seq_lengths"] == ours["seq_lengths"]
    for theirs, mine in zip(trl_packed, ours, strict=True):  # TRL masks each document's first label in its collator
        starts = {sum(theirs["seq_lengths"][:i]) for i in range(len(theirs["seq_lengths"]))}
        masked = [IGNORE_INDEX if i in starts else label for i, label in enumerate(theirs["labels"])]
        assert masked == mine["labels"]


def test_text_rows_pack_into_trls_blocks(tmp_path):
    rows = dataset("sft")
    tokenised = _trl(tmp_path, rows, packing=False).train_dataset  # TRL's own tokenisation, unpacked
    trl_packed = _trl(tmp_path, rows, packing=True).train_dataset
    assert len(trl_packed) < len(tokenised)
    _assert_same_blocks(trl_packed, pack_examples(tokenised, MAX_LENGTH))


def test_pretokenised_rows_with_masked_prompts_pack_into_trls_blocks(tmp_path):
    rows = _pretokenised()
    _assert_same_blocks(_trl(tmp_path, rows, packing=True).train_dataset, pack_examples(rows, MAX_LENGTH))


def test_shuffled_packing_holds_the_same_blocks_as_trls(tmp_path):
    """TRL shuffles before packing (as ``pack_examples(seed=)``) and again after; the blocks are the same set."""
    rows = _pretokenised(60)
    trl_packed = _trl(tmp_path, rows, packing=True, shuffle_dataset=True, seed=5).train_dataset
    ours = pack_examples(rows, MAX_LENGTH, seed=5)
    assert trl_packed["input_ids"] != ours["input_ids"]  # the order differs: TRL's second shuffle

    def blocks(data: Dataset) -> list:
        return sorted((tuple(r["input_ids"]), tuple(r["seq_lengths"])) for r in data)

    assert blocks(trl_packed) == blocks(ours)


def test_collated_batches_and_losses_equal_trls(tmp_path):
    rows = _pretokenised()
    trainer = _trl(tmp_path, rows, packing=True)
    trl_rows = [trainer.train_dataset[i] for i in range(4)]
    our_rows = [pack_examples(rows, MAX_LENGTH)[i] for i in range(4)]
    theirs = trainer.data_collator(trl_rows)  # padding-free: the batch as one row
    pad = trainer.processing_class.pad_token_id
    flat = SFTCollator(pad_token_id=pad, padding_free=True)(our_rows)
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(flat[key], theirs[key]), key
    batch = SFTCollator(pad_token_id=pad)(our_rows)  # ours by default: one row per block, right-padded
    assert batch["input_ids"].shape[0] == 4 and "attention_mask" not in batch
    real = batch["labels"] != IGNORE_INDEX
    assert torch.equal(batch["labels"][real], theirs["labels"][theirs["labels"] != IGNORE_INDEX])
    model = trainer.model.eval()
    with torch.no_grad():
        trl_loss = model(**theirs, use_cache=False).loss
        our_loss = model(**batch, use_cache=False).loss
    torch.testing.assert_close(our_loss, trl_loss, atol=1e-6, rtol=1e-6)
