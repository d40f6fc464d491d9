"""The models and data the kit trains: Llama-style decoders built from a config on the device, and token sequences
with a pattern a model can learn (so loss curves fall and their differences mean something)."""

from __future__ import annotations

from typing import Any

# name -> LlamaConfig fields; "dry" variants are what --dry_run trains on the CPU
LLAMAS: dict[str, dict[str, Any]] = {
    # about 110M parameters (tied embeddings)
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=True),
    # dimensions divisible by 16 so that float8 layers apply; about 20M parameters
    "fp8": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=8192, tie_word_embeddings=True),
    "sharded": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=False),
    "dry": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),
}  # fmt: skip


def llama(name: str, seq: int, device: str = "cpu", seed: int = 0) -> Any:
    """A freshly initialised LlamaForCausalLM of ``LLAMAS[name]``, its weights made on ``device`` (a GPU initialises
    100M parameters in milliseconds; the CPU in seconds)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=seq, attn_implementation="sdpa", **LLAMAS[name])
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(config)


def pattern_data(n: int, seq: int, vocab: int, seed: int = 0) -> Any:
    """``n`` sequences of ``seq`` tokens, each an arithmetic progression modulo ``vocab`` with a random start and a
    stride from a small set: a model learns them within tens of steps. A ``datasets.Dataset`` (torch format)."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    ids = (start + stride * torch.arange(seq)) % vocab
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}).with_format("torch")


def parameter_count(model: Any) -> int:
    """Parameters, each tensor once (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
