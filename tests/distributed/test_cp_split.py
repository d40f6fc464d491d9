"""The context-parallel core without processes: the load-balanced sequence split (``SequenceSplit``), the batch made
ready to split (``cp_batch.prepare_batch``, ``is_packed``) and the models context parallelism refuses
(``cp_model.why_not`` / ``check_model``) on configurations of real transformers architectures."""

from __future__ import annotations

import pytest
import torch
import transformers

from trainer_ext.distributed.mesh.context_parallel import SequenceSplit
from trainer_ext.distributed.mesh.cp_batch import SEQUENCE_KEYS, is_packed, prepare_batch
from trainer_ext.distributed.mesh.cp_model import check_model, why_not
from trainer_ext.errors import ConfigError

SPLITS = [SequenceSplit(cp, balance) for cp in (1, 2, 3, 4) for balance in (True, False)]


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# -- SequenceSplit ------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", SPLITS, ids=repr)
def test_indices_partition_the_sequence_and_shard_unshard_round_trip(split: SequenceSplit) -> None:
    assert split.multiple == (2 * split.cp_size if split.load_balance else split.cp_size)
    for length in (split.multiple, 3 * split.multiple):
        held = [split.indices(rank, length) for rank in range(split.cp_size)]
        assert all(len(h) == length // split.cp_size for h in held)
        assert sorted(torch.cat(held).tolist()) == list(range(length))
        assert torch.equal(split.gathered_indices(length), torch.cat(held))
        whole = torch.arange(2 * length * 3, dtype=torch.float64).reshape(2, length, 3)
        for dim, tensor in ((1, whole), (0, whole[0])):
            parts = [split.shard(tensor, dim, rank) for rank in range(split.cp_size)]
            assert all(torch.equal(p, tensor.index_select(dim, h)) for p, h in zip(parts, held, strict=True))
            assert torch.equal(split.unshard(parts, dim), tensor)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_rank_r_holds_chunks_r_and_its_mirror(cp: int) -> None:
    split, chunk = SequenceSplit(cp), 3
    length = split.multiple * chunk
    for rank in range(cp):
        mirror = 2 * cp - 1 - rank
        expected = [*range(rank * chunk, (rank + 1) * chunk), *range(mirror * chunk, (mirror + 1) * chunk)]
        assert split.indices(rank, length).tolist() == expected


def causal_work(split: SequenceSplit, length: int) -> list[int]:
    """(query, key) pairs with key <= query that each rank's queries attend over."""
    return [int((split.indices(rank, length) + 1).sum()) for rank in range(split.cp_size)]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_load_balancing_gives_every_rank_the_same_causal_work(cp: int) -> None:
    for length in (2 * cp, 2 * cp * 5):
        balanced = causal_work(SequenceSplit(cp), length)
        assert len(set(balanced)) == 1 and sum(balanced) == length * (length + 1) // 2, balanced
        contiguous = causal_work(SequenceSplit(cp, load_balance=False), length)
        assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1], contiguous


def test_check_length_names_the_multiple_and_the_collator_setting() -> None:
    SequenceSplit(2).check_length(8)
    with pytest.raises(ConfigError) as error:
        SequenceSplit(2).check_length(6)
    assert one_line(error) == (
        "context parallelism splits each sequence into 4 equal chunks, and this batch has 6 positions: pad the batch "
        "to a multiple of 4 (pad_to_multiple_of=4 in the data collator)"
    )
    with pytest.raises(ConfigError, match="into 3 equal chunks, and this batch has 7 positions"):
        SequenceSplit(3, load_balance=False).check_length(7)


# -- prepare_batch -------------------------------------------------------------------------------------
def right_padded() -> dict[str, torch.Tensor]:
    """Two rows of 7 and 4 tokens, right-padded to 7 (labels -100 on the padding)."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 0, 0, 0]])
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_shift_labels_are_built_before_the_split_and_every_tensor_padded_to_the_multiple() -> None:
    batch = right_padded()
    original = {k: v.clone() for k, v in batch.items()}
    prepared, buffers = prepare_batch(batch, SequenceSplit(2), "all_gather")
    shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    assert torch.equal(prepared["shift_labels"][:, :7], shifted)
    assert prepared["shift_labels"][0, 6] == -100  # the last label of a row is nobody's next token
    assert prepared["position_ids"].tolist() == [[*range(7), 0]] * 2
    padding = {"input_ids": 0, "attention_mask": 0, "labels": -100, "shift_labels": -100, "position_ids": 0}
    for key, value in padding.items():
        assert prepared[key].shape == (2, 8) and prepared[key][:, 7].tolist() == [value, value], key
        if key in batch:
            assert torch.equal(prepared[key][:, :7], batch[key]), key
    order = [k for k in SEQUENCE_KEYS if k in prepared]
    assert [id(b) for b in buffers] == [id(prepared[k]) for k in order]
    # the batch is copied: sharding the buffers in place must leave the caller's tensors whole
    assert all(b is not t for b in buffers for t in batch.values())
    assert batch.keys() == original.keys() and all(torch.equal(batch[k], original[k]) for k in batch)


def test_lengths_that_split_are_copied_not_padded_and_given_position_ids_are_kept() -> None:
    batch = right_padded()
    batch["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])  # one row, broadcast over the batch
    prepared, buffers = prepare_batch(batch, SequenceSplit(3, load_balance=False), "all_gather")
    assert prepared["input_ids"].shape == (2, 9)
    prepared, buffers = prepare_batch(batch, SequenceSplit(7, load_balance=False), "all_gather")
    assert prepared["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]] * 2
    assert torch.equal(prepared["input_ids"], batch["input_ids"]) and prepared["input_ids"] is not batch["input_ids"]
    assert len(buffers) == 5


def test_given_shift_labels_are_kept_and_a_batch_without_labels_gets_none() -> None:
    batch = right_padded()
    batch["shift_labels"] = torch.full_like(batch["labels"], 3)
    prepared, _ = prepare_batch(batch, SequenceSplit(2), "all_gather")
    assert prepared["shift_labels"][:, :7].eq(3).all()
    prepared, buffers = prepare_batch({"input_ids": batch["input_ids"]}, SequenceSplit(2), "all_gather")
    assert "shift_labels" not in prepared and sorted(prepared) == ["input_ids", "position_ids"] and len(buffers) == 2


def test_inputs_embeds_split_in_place_of_input_ids() -> None:
    embeds = torch.randn(2, 5, 3, dtype=torch.float64)
    prepared, buffers = prepare_batch({"inputs_embeds": embeds}, SequenceSplit(2), "all_gather")
    assert prepared["inputs_embeds"].shape == (2, 8, 3) and prepared["inputs_embeds"][:, 5:].eq(0).all()
    assert prepared["position_ids"].shape == (2, 8) and len(buffers) == 2


def test_refusals_of_the_batch() -> None:
    batch = right_padded()
    with pytest.raises(ConfigError) as error:
        prepare_batch({"attention_mask": batch["attention_mask"]}, SequenceSplit(2), "all_gather")
    assert "input_ids (or inputs_embeds)" in one_line(error)
    block = {**batch, "attention_mask": torch.ones(2, 1, 7, 7)}
    with pytest.raises(ConfigError) as error:
        prepare_batch(block, SequenceSplit(2), "all_gather")
    assert "2-D attention_mask (padding), not 4-D" in one_line(error) and "position_ids" in one_line(error)


def test_torch_backend_refuses_left_padding_and_packed_rows() -> None:
    prepare_batch(right_padded(), SequenceSplit(2), "torch")  # right padding is causal over the row: accepted
    left = right_padded()
    left["attention_mask"] = left["attention_mask"].flip(1)
    with pytest.raises(ConfigError) as error:
        prepare_batch(left, SequenceSplit(2), "torch")
    assert "left-padded" in one_line(error) and "cp_backend='all_gather'" in one_line(error)
    prepare_batch(left, SequenceSplit(2), "all_gather")  # ours masks any padding
    packed = {"input_ids": torch.arange(8).reshape(1, 8), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    with pytest.raises(ConfigError) as error:
        prepare_batch(packed, SequenceSplit(2), "torch")
    assert "packs several documents" in one_line(error) and "cp_backend='all_gather'" in one_line(error)
    prepare_batch(packed, SequenceSplit(2), "all_gather")


def test_is_packed() -> None:
    restart = torch.tensor([[0, 1, 2, 0, 1]])
    assert is_packed({"input_ids": restart, "position_ids": restart})
    assert not is_packed({"position_ids": restart, "attention_mask": torch.ones(1, 5)})
    assert not is_packed({"position_ids": torch.arange(5).reshape(1, 5)})
    assert not is_packed({"position_ids": torch.tensor([0, 1, 2, 0, 1])})
    assert not is_packed({"input_ids": restart}) and not is_packed([restart])


# -- models ---------------------------------------------------------------------------------------------
PASS = {
    "llama": transformers.LlamaConfig(),
    "qwen3": transformers.Qwen3Config(),
    "qwen2": transformers.Qwen2Config(),
    "mistral without a window": transformers.MistralConfig(sliding_window=None),
    "gpt2": transformers.GPT2Config(),
}
REFUSED = {
    "mistral": (transformers.MistralConfig(sliding_window=64), "mistral uses sliding-window attention (64 tokens)"),
    "qwen2 sliding": (
        transformers.Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0),
        "qwen2 has 32 sliding-attention layers, which context parallelism would train with full causal attention",
    ),
    "gemma2": (transformers.Gemma2Config(), "gemma2 has 13 sliding-attention layers"),
    "gemma2 soft-capping": (
        transformers.Gemma2Config(layer_types=["full_attention"] * 26, sliding_window=None),
        "gemma2 soft-caps its attention scores (attn_logit_softcapping)",
    ),
    "gemma3": (transformers.Gemma3Config(), "gemma3_text has 22 sliding-attention layers"),
    "llama4 chunked": (transformers.Llama4Config(), "llama4_text has 36 chunked-attention layers"),
    "chunked, no layer types": (
        transformers.LlamaConfig(attention_chunk_size=128),
        "llama uses chunked attention (128 tokens)",
    ),
    "bert": (transformers.BertConfig(), "bert is not a causal language model"),
    "t5": (transformers.T5Config(), "t5 is an encoder-decoder model"),
}


@pytest.mark.parametrize("name", PASS)
def test_causal_decoders_with_full_attention_pass(name: str) -> None:
    assert why_not(PASS[name]) is None
    check_model(PASS[name], 2)


@pytest.mark.parametrize("name", REFUSED)
def test_models_context_parallelism_would_train_wrongly_are_refused_in_one_line(name: str) -> None:
    config, reason = REFUSED[name]
    assert reason in why_not(config)
    with pytest.raises(ConfigError) as error:
        check_model(config, 4)
    message = one_line(error)
    assert message.startswith(f"cp_size=4: {reason}") and message.endswith(
        "; train it with cp_size=1 (use dp_shard_size or tp_size)"
    ), message


def test_a_model_is_checked_by_its_configuration_and_its_modules() -> None:
    from tests.distributed.tensor_parallel_job import tiny_model

    model = tiny_model("llama")
    check_model(model, 2)
    model.model.layers[1].self_attn.is_causal = False
    with pytest.raises(ConfigError) as error:
        check_model(model, 2)
    assert "LlamaForCausalLM has bidirectional attention layers" in one_line(error)


def test_a_head_that_reads_whole_sequences_is_refused() -> None:
    """A sequence-classification head (TRL's reward model) pools one token of each row: a rank's slice holds another."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, pad_token_id=0
    )
    model = transformers.LlamaForSequenceClassification(config)
    assert why_not(config) is None  # the configuration alone is a causal decoder's
    with pytest.raises(ConfigError) as error:
        check_model(model, 2)
    assert "LlamaForSequenceClassification reads whole sequences" in one_line(error)
    check_model(transformers.LlamaForCausalLM(config), 2)
