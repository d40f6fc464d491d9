"""Tiny models for the dispatch tests, built from configs (no hub), with sizes the tests can reason about."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

# Llama below, float32: embed_tokens 32,768 B; each decoder layer 147,968 B; norm 256 B;
# rotary buffers 64 B; lm_head 32,768 B when untied. Total 624,960 B tied, 657,728 B untied.
EMBED, LAYER = 32_768, 147_968


def llama_config(tied: bool = True, layers: int = 4, **overrides) -> LlamaConfig:
    """The test model's config: 4 layers of width 64, vocabulary 128."""
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def make_llama(tied: bool = True, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random Llama in eval mode, weights fixed by ``seed``."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(tied, **overrides)).eval()


def make_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """A random 3-block GPT-2 (Conv1D layers, tied lm_head) in eval mode."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=128, n_embd=32, n_layer=3, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    return GPT2LMHeadModel(config).eval()


def prompt(batch: int = 2, length: int = 9, seed: int = 1) -> torch.Tensor:
    """Token ids that avoid the special tokens."""
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
