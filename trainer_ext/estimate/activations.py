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

Context parallelism over ``C`` ranks: each rank holds ``2c`` positions of every sequence (two chunks of
``c = seq / 2C``, the sequence padded to a multiple of ``2C``), and everything above counts those local tokens, except
attention. With ``all_gather`` (ours; measured on gloo ranks within 0.1 %, Llama with grouped and plain heads, C = 2
and 4) every rank keeps the keys and values of the whole sequence of every layer for backward, in global order:
``2 * kv_dim * C`` elements per local token in place of its own ``2 * kv_dim`` (on CUDA repeated to the query heads,
``2 * heads * head_dim * C``; on CPU SDPA takes grouped heads), plus the attention output's copy (``h``) per layer,
rotary tables per row (``2 * head_dim`` outside the layers in place of ``head_dim``), and once per forward (every
layer shares it) an additive mask over each run of local queries and the keys up to its last query:
``(C + 1) * c`` elements per local token on the busiest rank; transformers' padded-batch mask is not built. GPT-2
(SDPA's math path, dropout on) saves its scores over those keys (``3 * heads * (C + 1) * c``), every rank's values
and a copy of the keys up to each run instead of the mask (within 0.1 %). With ``torch``
(ring attention, CUDA only; not measured here) a rank keeps only its own keys and values, repeated to the query heads
(``2 * heads * head_dim``), and no mask.
"""

from __future__ import annotations

from trainer_ext.estimate.setup import Setup
from trainer_ext.estimate.shape import ModelShape

GPT2_LIKE = ("gpt2", "gpt_neo", "gptj", "codegen")
BERT_LIKE = ("bert", "roberta", "distilbert", "electra", "deberta", "deberta-v2", "xlm-roberta", "camembert")


def cp_keys(seq_len: int, cp_size: int) -> int:
    """Under ``all_gather``: the keys a local query attends to, on average over the busiest rank's queries (each run
    of consecutive local queries attends to the keys up to its last one): ``(cp + 1) * c`` for chunks of ``c``."""
    return (cp_size + 1) * (seq_len // (2 * cp_size))


def layer_elements(
    shape: ModelShape,
    seq_len: int,
    tp_size: int = 1,
    cp_size: int = 1,
    cp_backend: str = "all_gather",
    device_type: str = "cpu",
) -> float:
    """Elements saved per (local) token by one layer on one rank (``tp_size``: the tensor-parallel ranks splitting
    it; ``cp_size``: the context-parallel ranks splitting the sequence of ``seq_len`` positions, padded; the
    ``device_type`` decides whether all_gather's keys and values are repeated to the query heads)."""
    h, i, heads = shape.hidden, shape.intermediate, shape.heads
    cp = cp_size > 1
    gathered = cp and cp_backend == "all_gather"
    if shape.model_type in GPT2_LIKE:
        if not gathered:
            return 10 * h + 5 * i + 3 * heads * (seq_len // max(cp_size, 1)) + 4
        # the scores over the keys up to each query run, every rank's values, the keys of that prefix (copied)
        keys, local = cp_keys(seq_len, cp_size), seq_len // cp_size
        return 10 * h + 5 * i + 3 * heads * keys + 4 + h * (cp_size - 1) + h * (keys / local - 1)
    eager = 2 * heads * seq_len if shape.attn_implementation == "eager" and not cp else 0
    if shape.model_type in BERT_LIKE:
        return 8 * h + 2 * i + heads + 4 + eager
    kv_dim = shape.kv_heads * shape.head_dim
    whole = 4 * h + 2  # the two norms
    split = 4 * h + 2 * kv_dim + 4 * i + heads + eager  # between the colwise and the rowwise projections
    if gathered:  # every rank's keys and values, repeated to the query heads where SDPA takes no grouped heads
        repeat = shape.heads // max(shape.kv_heads, 1) if device_type == "cuda" else 1
        split += 2 * kv_dim * (cp_size * repeat - 1) + h
    elif cp:  # torch's ring attention: its own keys and values, repeated
        split += 2 * heads * shape.head_dim - 2 * kv_dim + h
    return whole + split / max(tp_size, 1)


def outer_elements(shape: ModelShape, cp_size: int = 1) -> float:
    """Elements saved per (local) token outside the layers (embeddings, final norm, head input)."""
    h = shape.hidden
    if shape.model_type in GPT2_LIKE:
        return 3 * h + 7
    if shape.model_type in BERT_LIKE:
        return 5 * h + 20 if shape.causal_lm else 2 * h + 14
    return 3 * h + shape.head_dim * (2 if cp_size > 1 else 1) + 5  # rotary tables per row under cp


def logits_bytes_per_token(shape: ModelShape) -> int:
    """The fp32 log-softmax of a causal LM's logits, saved for the loss's backward."""
    return 4 * shape.vocab if shape.causal_lm else 0


# a padded batch (a classifier's, a causal LM's last short block) materialises the attention mask, batch x seq x seq
MASK_BYTES = 12


def _per_layer(shape: ModelShape, setup: Setup, checkpointing: bool) -> float:
    if checkpointing:
        return shape.hidden
    return layer_elements(
        shape, setup.padded_seq_len, setup.tp_size, setup.cp_size, setup.cp_backend, setup.device_type
    )


def mask_bytes(shape: ModelShape, setup: Setup, tokens: int, checkpointing: bool) -> float:
    """The attention mask one micro-batch of ``tokens`` (local) tokens keeps: transformers' padded-batch mask, or
    under all_gather its additive mask, built once per forward (and again per recomputed layer: a transient)."""
    if setup.cp_size <= 1:
        return MASK_BYTES * tokens * setup.seq_len
    if setup.cp_backend != "all_gather" or checkpointing or shape.model_type in BERT_LIKE + GPT2_LIKE:
        return 0  # GPT-2's math path adds the mask to its scores: nothing to keep
    return tokens * cp_keys(setup.padded_seq_len, setup.cp_size) * setup.compute_bytes


def activation_bytes(shape: ModelShape, setup: Setup, batch: int, checkpointing: bool) -> int:
    """Bytes saved for backward by one micro-batch of ``batch`` sequences (this rank's part of them under cp)."""
    tokens = batch * setup.local_seq_len
    elements = shape.num_layers * _per_layer(shape, setup, checkpointing) + outer_elements(shape, setup.cp_size)
    mask = mask_bytes(shape, setup, tokens, checkpointing)
    return int(tokens * (elements * setup.compute_bytes + logits_bytes_per_token(shape)) + mask)


def transient_activation_bytes(shape: ModelShape, setup: Setup, batch: int, checkpointing: bool) -> int:
    """Short-lived activation memory at the peak, not saved for backward: the logits and their gradient around the
    loss (compute dtype + fp32 gradient), and under checkpointing the one layer recomputed in backward. DPO's
    reference forward (under no_grad, after the policy's) holds its logits beside the policy's and one sequence's
    float32 log-softmax at a time; its layers' intermediates, freed layer by layer, are smaller and not counted."""
    tokens = batch * setup.local_seq_len
    out = tokens * shape.vocab * (setup.compute_bytes + 4) if shape.causal_lm else 0
    if setup.reference_forward and shape.causal_lm:  # DPO's reference forward, the policy's logits held meanwhile
        out = max(out, tokens * shape.vocab * 2 * setup.compute_bytes + setup.local_seq_len * shape.vocab * 4)
    if checkpointing:
        out += tokens * _per_layer(shape, setup, False) * setup.compute_bytes
        if setup.cp_size > 1:  # the recomputed layer rebuilds all_gather's mask
            out += mask_bytes(shape, setup, tokens, False)
    return int(out)
