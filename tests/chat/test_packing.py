"""Packing: best-fit-decreasing blocks, the SFT collator, and exactness of packed forwards/steps vs unpacked ones."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from datasets import Dataset

from trainer_ext.chat.packing import (
    IGNORE_INDEX,
    SFTCollator,
    best_fit_decreasing,
    check_packing_supported,
    pack_examples,
    packing_supported,
)
from trainer_ext.errors import ConfigError

VOCAB = 96
PAD = 0
_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def _model(kind: str = "llama", attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**_SIZES, vocab_size=VOCAB)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**_SIZES, vocab_size=VOCAB)
    elif kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
        config.bos_token_id = config.eos_token_id = 1
    elif kind == "opt":
        config = transformers.OPTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, vocab_size=VOCAB
        )
        config.word_embed_proj_dim = 64
    else:
        raise AssertionError(kind)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()


def _docs(n: int = 7, longest: int = 12, seed: int = 0) -> list[dict[str, list[int]]]:
    """Tokenised SFT rows: random ids, a masked 'prompt' prefix in the labels."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, longest))]
        prompt = rng.randint(0, len(ids) - 1)
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return rows


def _dataset(rows: list[dict[str, list[int]]]) -> Dataset:
    return Dataset.from_dict({key: [row[key] for row in rows] for key in rows[0]})


def _forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs, use_cache=False).logits  # a cache would switch off the packed-document mask


def _loss_sum_and_count(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    shift_logits, shift_labels = logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
    loss = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, int((shift_labels != IGNORE_INDEX).sum())


def _split(packed_row: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return list(packed_row[: sum(lengths)].split(lengths))


# ---- best-fit-decreasing -------------------------------------------------------------------------------------------


def test_best_fit_decreasing_matches_a_hand_packed_example():
    # lengths 4,2,3,1 into 4: 4 alone, 3 then 1 fills the 3's bin, 2 opens a third bin (TRL's docstring example)
    assert best_fit_decreasing([4, 2, 3, 1], 4) == [[0], [2, 3], [1]]
    # equal lengths keep their row order; the tightest open bin wins, the oldest among equals
    assert best_fit_decreasing([3, 3, 2, 2, 1], 5) == [[0, 2], [1, 3], [4]]


def test_pack_examples_keeps_every_token_once_within_max_length_and_is_deterministic():
    rows = _docs(n=60, longest=16, seed=1)
    packed = pack_examples(_dataset(rows), max_seq_length=16)
    again = pack_examples(_dataset(rows), max_seq_length=16)
    assert packed[:] == again[:]
    assert len(packed) < len(rows)
    seen = []
    for block in packed:
        assert len(block["input_ids"]) <= 16
        assert (
            len(block["input_ids"]) == len(block["labels"]) == len(block["position_ids"]) == sum(block["seq_lengths"])
        )
        start = 0
        for length in block["seq_lengths"]:
            assert block["position_ids"][start : start + length] == list(range(length))
            assert block["labels"][start] == IGNORE_INDEX
            seen.append(
                (tuple(block["input_ids"][start : start + length]), tuple(block["labels"][start + 1 : start + length]))
            )
            start += length
    expected = [(tuple(r["input_ids"]), tuple(r["labels"][1:])) for r in rows]
    assert sorted(seen) == sorted(expected)


def test_pack_examples_with_seed_shuffles_first_and_refuses_rows_longer_than_max_length():
    rows = _docs(n=40, longest=10, seed=2)
    plain, shuffled = pack_examples(_dataset(rows), 10), pack_examples(_dataset(rows), 10, seed=3)
    assert plain["input_ids"] != shuffled["input_ids"]
    assert sorted(sum(plain["input_ids"], [])) == sorted(sum(shuffled["input_ids"], []))
    assert shuffled[:] == pack_examples(_dataset(rows), 10, seed=3)[:]
    with pytest.raises(ConfigError, match="row 0 has 3 tokens, more than max_seq_length 2"):
        pack_examples(_dataset([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]), 2)


# ---- collator ------------------------------------------------------------------------------------------------------


def test_collator_pads_right_masks_labels_and_rounds_up_for_unpacked_rows():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = SFTCollator(pad_token_id=PAD, pad_to_multiple_of=4)(rows)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100], [8, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]


def test_collator_packed_rows_have_position_ids_no_attention_mask_and_masked_boundaries():
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9], "seq_lengths": [3, 2]},  # TRL-style row
        {"input_ids": [3, 4], "labels": [3, 4], "position_ids": [0, 1]},
    ]
    batch = SFTCollator(pad_token_id=PAD)(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, 4, -100, -100, -100]]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [3, 4, 0, 0, 0]]
    flat = SFTCollator(pad_token_id=PAD, padding_free=True)(rows)
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert flat["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 4]]
    with pytest.raises(ConfigError, match="mixes packed rows"):
        SFTCollator(pad_token_id=PAD)([rows[1], {"input_ids": [1]}])


# ---- exactness -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_packed_forward_equals_unpacked_per_document(kind):
    model = _model(kind).eval()
    assert packing_supported(model)
    rows = _docs(n=6, longest=10, seed=4)
    packed = pack_examples(_dataset(rows), max_seq_length=24)
    assert any(len(block["seq_lengths"]) > 1 for block in packed)
    collate = SFTCollator(pad_token_id=PAD)
    with torch.no_grad():
        batch = collate(list(packed))  # several packed rows of different lengths in one batch
        assert batch["input_ids"].shape[0] > 1
        logits = _forward(model, batch)
        for i, block in enumerate(packed):
            pieces = _split(logits[i], block["seq_lengths"])
            start = 0
            for length, piece in zip(block["seq_lengths"], pieces, strict=True):
                ids = torch.tensor(block["input_ids"][start : start + length])[None]
                alone = model(input_ids=ids, use_cache=False).logits[0]
                torch.testing.assert_close(piece, alone, atol=1e-5, rtol=0)
                start += length


def test_packed_forward_with_plain_positions_differs_so_the_test_can_fail():
    model = _model("llama").eval()
    packed = pack_examples(_dataset(_docs(n=6, longest=10, seed=4)), max_seq_length=24)
    block = next(b for b in packed if len(b["seq_lengths"]) > 1)
    batch = SFTCollator(pad_token_id=PAD)([block])
    with torch.no_grad():
        good = _forward(model, batch)[0]
        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]  # no reset: one long document
        bad = _forward(model, batch)[0]
        second = block["seq_lengths"][0]
        ids = torch.tensor(block["input_ids"][second : second + block["seq_lengths"][1]])[None]
        alone = model(input_ids=ids, use_cache=False).logits[0]
    torch.testing.assert_close(good[second : second + ids.shape[1]], alone, atol=1e-5, rtol=0)
    assert (bad[second : second + ids.shape[1]] - alone).abs().max() > 1e-3


def test_packed_batch_loss_sum_and_count_equal_the_unpacked_batch():
    model = _model("llama").eval()
    rows = _docs(n=8, longest=12, seed=5)
    collate = SFTCollator(pad_token_id=PAD)
    packed = pack_examples(_dataset(rows), max_seq_length=20)
    with torch.no_grad():
        packed_batch, plain_batch = collate(list(packed)), collate(rows)
        packed_loss, packed_count = _loss_sum_and_count(_forward(model, packed_batch), packed_batch["labels"])
        plain_loss, plain_count = _loss_sum_and_count(_forward(model, plain_batch), plain_batch["labels"])
    assert packed_count == plain_count > 0
    torch.testing.assert_close(packed_loss, plain_loss, atol=1e-4, rtol=1e-6)


def test_one_optimizer_step_on_packed_data_gives_the_same_weights():
    rows = _docs(n=8, longest=12, seed=6)
    collate = SFTCollator(pad_token_id=PAD)
    packed_batch = collate(list(pack_examples(_dataset(rows), max_seq_length=20)))
    weights = []
    for batch in (packed_batch, collate(rows)):
        model = _model("llama").train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        loss, count = _loss_sum_and_count(_forward(model, batch), batch["labels"])
        (loss / count).backward()
        optimizer.step()
        weights.append({name: p.detach().clone() for name, p in model.named_parameters()})
    moved = _model("llama").state_dict()
    assert any((weights[0][n] - moved[n]).abs().max() > 1e-4 for n in weights[0])
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], atol=1e-6, rtol=0, msg=name)


# ---- which models pack -------------------------------------------------------------------------------------------


def test_a_model_that_ignores_position_ids_for_its_mask_is_refused_and_really_mixes_documents():
    model = _model("opt").eval()  # OPT builds its mask without position_ids
    assert not packing_supported(model)
    with pytest.raises(ConfigError, match="--packing needs a model that builds its attention mask from position_ids"):
        check_packing_supported(model)
    block = {"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9], "seq_lengths": [3, 2]}
    with torch.no_grad():
        logits = _forward(model, SFTCollator(pad_token_id=PAD)([block]))[0]
        alone = model(input_ids=torch.tensor([[8, 9]]), use_cache=False).logits[0]
    assert (logits[3:] - alone).abs().max() > 1e-3


def test_packing_supported_needs_an_attention_that_masks_documents():
    model = _model("llama")
    check_packing_supported(model)
    model.config._attn_implementation = "paged|sdpa"
    assert not packing_supported(model)


def test_packing_supported_sees_through_a_wrapper_subclass():
    model = _model("llama")
    model.__class__ = type("FSDPLlamaForCausalLM", (type(model),), {})  # as FSDP2's fully_shard does
    assert packing_supported(model)
    opt = _model("opt")
    opt.__class__ = type("FSDPOPTForCausalLM", (type(opt),), {})
    assert not packing_supported(opt)
