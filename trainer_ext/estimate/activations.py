"""Bytes saved for backward by one micro-batch, as a formula in batch, sequence, hidden, heads, intermediate, vocab.

Per token, in elements of the compute dtype (4 bytes in fp32, 2 under bf16/fp16), calibrated against the bytes the
saved-tensors hook counts on CPU (``torch.autograd.graph.saved_tensors_hooks``, one count per storage) for tiny
configs with hidden 64-128, intermediate 128-512, 2-8 heads, sequence 32-128 (fits exact to the element):

==========  ===========================================  ==========================
family      per layer                                    outside the layers
==========  ===========================================  ==========================
llama-like  8h + 2*kv_dim + 4i + heads + 2                3h + head_dim + 5
gpt2        10h + 5i + 3*heads*seq + 4 (dropout 0.1 on)  3h + 7
bert        8h + 2i + heads + 4                          5h + 20 (LM), 2h + 14 (classifier)
==========  ===========================================  ==========================

Tensor parallelism over ``T`` ranks (llama-like models, the family with a tensor-parallel plan) divides by ``T`` what
lies between a layer's column-parallel projections and its row-parallel ones: ``4h + 2*kv_dim + 4i + heads`` (the
query/key/value and their rotary forms, the attention output and its log-sum-exp, the MLP's gate, up, activation and
product), and eager attention's probabilities; the two norms' ``4h + 2`` (their inputs, outputs and per-token scale,
whole on every rank) and everything outside the layers (the logits gathered whole) stay as they are.

A causal LM adds the log-softmax of the logits, always fp32: ``4 * vocab`` bytes per token. Eager attention adds
the probabilities (``2 * heads * seq`` elements per token, not calibrated). A padded batch (always possible: a
classifier pads to the longest example, a causal LM's last block is short) materialises the attention mask:
``12 * batch * seq**2`` bytes (measured). Activation checkpointing keeps each
layer's input (``h`` per token per layer) and recomputes one layer at a time in backward (a transient).
"""

from __future__ import annotations

from trainer_ext.estimate.setup import Setup
from trainer_ext.estimate.shape import ModelShape

GPT2_LIKE = ("gpt2", "gpt_neo", "gptj", "codegen")
BERT_LIKE = ("bert", "roberta", "distilbert", "electra", "deberta", "deberta-v2", "xlm-roberta", "camembert")


def layer_elements(shape: ModelShape, seq_len: int, tp_size: int = 1) -> float:
    """Elements saved per token by one layer on one rank (``tp_size``: the tensor-parallel ranks splitting it)."""
    h, i, heads = shape.hidden, shape.intermediate, shape.heads
    eager = 2 * heads * seq_len if shape.attn_implementation == "eager" else 0
    if shape.model_type in GPT2_LIKE:
        return 10 * h + 5 * i + 3 * heads * seq_len + 4
    if shape.model_type in BERT_LIKE:
        return 8 * h + 2 * i + heads + 4 + eager
    kv_dim = shape.kv_heads * shape.head_dim
    whole = 4 * h + 2  # the two norms
    split = 4 * h + 2 * kv_dim + 4 * i + heads + eager  # between the colwise and the rowwise projections
    return whole + split / max(tp_size, 1)


def outer_elements(shape: ModelShape) -> float:
    """Elements saved per token outside the layers (embeddings, final norm, head input)."""
    h = shape.hidden
    if shape.model_type in GPT2_LIKE:
        return 3 * h + 7
    if shape.model_type in BERT_LIKE:
        return 5 * h + 20 if shape.causal_lm else 2 * h + 14
    return 3 * h + shape.head_dim + 5


def logits_bytes_per_token(shape: ModelShape) -> int:
    """The fp32 log-softmax of a causal LM's logits, saved for the loss's backward."""
    return 4 * shape.vocab if shape.causal_lm else 0


# a padded batch (a classifier's, a causal LM's last short block) materialises the attention mask, batch x seq x seq
MASK_BYTES = 12


def activation_bytes(shape: ModelShape, setup: Setup, batch: int, checkpointing: bool) -> int:
    """Bytes saved for backward by one micro-batch of ``batch`` sequences."""
    tokens = batch * setup.seq_len
    per_layer = shape.hidden if checkpointing else layer_elements(shape, setup.seq_len, setup.tp_size)
    elements = shape.num_layers * per_layer + outer_elements(shape)
    mask = MASK_BYTES * tokens * setup.seq_len
    return int(tokens * (elements * setup.compute_bytes + logits_bytes_per_token(shape)) + mask)


def transient_activation_bytes(shape: ModelShape, setup: Setup, batch: int, checkpointing: bool) -> int:
    """Short-lived activation memory at the peak, not saved for backward: the logits and their gradient around the
    loss (compute dtype + fp32 gradient), and under checkpointing the one layer recomputed in backward."""
    tokens = batch * setup.seq_len
    out = tokens * shape.vocab * (setup.compute_bytes + 4) if shape.causal_lm else 0
    if checkpointing:
        out += tokens * layer_elements(shape, setup.seq_len, setup.tp_size) * setup.compute_bytes
    return int(out)
