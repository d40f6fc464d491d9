"""Which models context parallelism trains exactly: causal decoders whose attention goes through transformers'
``AttentionInterface``, with full causal attention in every layer. Anything else is refused in one line before the
first step (a sliding-window or chunked model silently trained with full attention is accelerate#4177's bug).

Reads only a model's configuration, so ``train`` and ``launch`` check before any process starts.
"""

from __future__ import annotations

from typing import Any

from trainer_ext.errors import ConfigError

# layer types that attend to less than every earlier token
_LOCAL_LAYER_TYPES = ("sliding_attention", "chunked_attention", "local_attention")


def _config_of(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    text = getattr(config, "get_text_config", None)
    return text() if callable(text) else config


def why_not(model_or_config: Any) -> str | None:
    """The reason context parallelism would train this model wrongly, or None when it trains it exactly."""
    config = _config_of(model_or_config)
    model_type = getattr(config, "model_type", None) or type(config).__name__
    if getattr(config, "is_encoder_decoder", False):
        return f"{model_type} is an encoder-decoder model; context parallelism splits causal decoders only"
    if getattr(config, "is_causal", True) is False:
        return f"{model_type}'s attention is bidirectional (is_causal=False); the context-parallel mask is causal"
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or encoder:
        return f"{model_type} is not a causal language model; context parallelism splits causal decoders only"
    layer_types = [t for t in (getattr(config, "layer_types", None) or ()) if t in _LOCAL_LAYER_TYPES]
    if layer_types:
        return (
            f"{model_type} has {len(layer_types)} {layer_types[0].replace('_', '-')} layers, which context parallelism "
            "would train with full causal attention"
        )
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:
        return (
            f"{model_type} uses sliding-window attention ({window} tokens), which context parallelism cannot express"
        )
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk:
        return f"{model_type} uses chunked attention ({chunk} tokens), which context parallelism cannot express"
    for name in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, name, None):
            return f"{model_type} soft-caps its attention scores ({name}), which context-parallel attention does not"
    return None


def _whole_sequence_head(model: Any) -> str | None:
    """The class name of a head that pools or reads whole sequences (classification, QA, multiple choice), or None."""
    from transformers.models.auto import modeling_auto

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's own
    name = type(inner).__name__
    for mapping in _WHOLE_SEQUENCE_MAPPINGS:
        if name in getattr(modeling_auto, mapping, {}).values():
            return name
    return None


_WHOLE_SEQUENCE_MAPPINGS = (
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
)


def check_model(model_or_config: Any, cp_size: int) -> None:
    """ConfigError naming the model and the reason when context parallelism (``cp_size`` > 1) cannot train it."""
    reason = why_not(model_or_config)
    if reason is None and hasattr(model_or_config, "config"):
        head = _whole_sequence_head(model_or_config)
        if head is not None:
            reason = f"{head} reads whole sequences (a pooled or per-sequence head), and each rank holds a slice"
        elif getattr(model_or_config, "_supports_attention_backend", True) is False:
            reason = f"{type(model_or_config).__name__} does not route its attention through AttentionInterface"
        elif any(getattr(m, "is_causal", True) is False for m in model_or_config.modules()):
            reason = f"{type(model_or_config).__name__} has bidirectional attention layers; the context-parallel mask is causal"
        elif any(hasattr(m, "sinks") for m in model_or_config.modules()):
            reason = f"{type(model_or_config).__name__} has attention sinks, which context-parallel attention lacks"
    if reason is not None:
        raise ConfigError(f"cp_size={cp_size}: {reason}; train it with cp_size=1 (use dp_shard_size or tp_size)")
