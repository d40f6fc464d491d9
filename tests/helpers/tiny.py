"""Tiny deterministic models and datasets shared by the tests (built from configs, no hub)."""

from __future__ import annotations

import numpy as np
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

VOCAB = 64


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights fixed by ``seed``."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def lm_dataset(n: int, seq_len: int = 12, seed: int = 0) -> Dataset:
    """``n`` token sequences with a learnable pattern (each token is the previous one plus one)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(3, VOCAB - seq_len, (n, 1), generator=g)
    ids = (start + torch.arange(seq_len)).clamp(max=VOCAB - 1)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def ragged_lm_dataset(n: int, min_len: int = 4, max_len: int = 16, seed: int = 0) -> Dataset:
    """``n`` sequences of random length in [min_len, max_len] with the same learnable pattern."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        start = int(torch.randint(3, VOCAB - length, (1,), generator=g))
        rows.append(list(range(start, start + length)))
    return Dataset.from_dict({"input_ids": rows})


def pad_right(features: list[dict]) -> dict[str, torch.Tensor]:
    """Pad a batch on the right: pad id 0, labels -100 on padding, attention mask."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full((len(features), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for i, f in enumerate(features):
        row = torch.as_tensor(f["input_ids"])
        ids[i, : len(row)] = row
        labels[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def tiny_t5(seed: int = 0) -> T5ForConditionalGeneration:
    """A 2-layer T5 from a config, without dropout (N ranks must draw what 1 does); token 0 pads and starts
    decoding, 1 ends."""
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
    )
    config.decoder_start_token_id = 0
    return T5ForConditionalGeneration(config)


def copy_rows(n: int, seed: int) -> Dataset:
    """Sources of 10 tokens; each target is its source's first 5 tokens and the end token."""
    ids = np.random.default_rng(seed).integers(2, VOCAB, size=(n, 10))
    labels = np.concatenate([ids[:, :5], np.ones((n, 1), dtype=ids.dtype)], axis=1)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
