"""Tiny deterministic models and datasets shared by the tests (built from configs, no hub)."""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

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
