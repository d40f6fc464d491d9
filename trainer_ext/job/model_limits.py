"""The ranges a model config's sizes must lie in, checked before any model is built (``estimate`` and ``train``).

Every size a transformers config gives (layers, widths, heads, vocabulary, positions, labels, experts) must be a
whole number in its range, heads must divide the width and key/value heads the heads, and the model the sizes
describe must stay under :data:`MAX_PARAMETERS`. The bounds sit far above any published model and keep
``estimate`` (which builds every layer on the meta device) and ``train`` from hanging or overflowing:
:data:`MAX_LAYERS` layers, :data:`MAX_WIDTH` per width, :data:`MAX_TOKENS` vocabulary entries and positions.
Each refusal is one ConfigError line naming the field, the file, the valid range and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import transformers

from trainer_ext.config_files import JSON, load_mapping
from trainer_ext.errors import ConfigError

MAX_LAYERS = 1024  # the deepest published models have under 200 layers; 10^5 takes minutes even on the meta device
MAX_WIDTH = 2**20  # hidden / intermediate / head width: published models stay under 2^16
MAX_HEADS = 2**14
MAX_TOKENS = 2**24  # vocabulary entries and positions (16,777,216)
MAX_LABELS = 2**20
MAX_EXPERTS = 2**12
MAX_PARAMETERS = 10**13  # ten trillion: five times the largest published model

# field -> (smallest, largest, what it counts); the names of the size fields transformers' configs use
LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers")
LAYERS += ("encoder_layers", "decoder_layers")
WIDTHS = ("hidden_size", "n_embd", "d_model", "dim", "intermediate_size", "n_inner", "ffn_dim", "d_ff", "hidden_dim")
WIDTHS += ("encoder_ffn_dim", "decoder_ffn_dim", "head_dim", "d_kv", "kv_channels", "moe_intermediate_size")
HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads")
RANGES: dict[str, tuple[int, int, str]] = {
    **{name: (0, MAX_LAYERS, "layers") for name in LAYERS},
    **{name: (1, MAX_WIDTH, "a width") for name in WIDTHS},
    **{name: (1, MAX_HEADS, "attention heads") for name in HEADS + KV_HEADS},
    "vocab_size": (1, MAX_TOKENS, "vocabulary entries"),
    "max_position_embeddings": (1, MAX_TOKENS, "positions"),
    "n_positions": (1, MAX_TOKENS, "positions"),
    "n_ctx": (1, MAX_TOKENS, "positions"),
    "num_labels": (1, MAX_LABELS, "labels"),
    **{name: (0, MAX_EXPERTS, "experts") for name in ("num_local_experts", "num_experts", "n_routed_experts")},
    "num_experts_per_tok": (0, MAX_EXPERTS, "experts"),
}
HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
INTERMEDIATE = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "hidden_dim")
HEAD_WIDTH = ("head_dim", "d_kv", "kv_channels")  # given explicitly, the width need not divide by the heads


def _first(values: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, int] | None:
    """The first of ``names`` set to a whole number in ``values``, with its name."""
    for name in names:
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None


def _check_range(name: str, value: Any, source: str) -> None:
    low, high, counts = RANGES[name.rsplit(".", 1)[-1]]
    items = value if isinstance(value, list) else [value]  # per-layer lists (some hybrid models) hold one per layer
    for item in items:
        whole = isinstance(item, int) and not isinstance(item, bool)
        if whole and low <= item <= high:
            continue
        shown = _shown(item)
        if whole:
            why = "too large" if item > high else "too small"
        elif isinstance(item, float) and item.is_integer():
            why = "written as a decimal: a whole number has no point or exponent"
        else:
            why = "not a whole number" if isinstance(item, float) else "not a number"
        raise ConfigError(
            f"{name} in {source} is {shown} ({why}): it counts {counts} and must be a whole number from {low} to "
            f"{high:,}; set it in that range in the file"
        )


def _shown(value: Any) -> str:
    """A value as the message shows it: numbers as written, a very long integer by its digits, others by repr."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool):
        digits = len(str(abs(value))) if abs(value).bit_length() < 14000 else None
        return str(value) if digits is not None and digits <= 24 else f"a {digits or 'many'}-digit number"
    return " ".join(repr(value).split())[:60]


def _check_heads(values: Mapping[str, Any], prefix: str, source: str) -> None:
    """Heads divide the width (unless a head width is given) and key/value heads divide the heads."""
    hidden = _first(values, HIDDEN)
    explicit = _first(values, HEAD_WIDTH)
    for name in HEADS:
        heads = values.get(name)
        if not isinstance(heads, int) or isinstance(heads, bool):
            continue
        if hidden and not explicit and hidden[1] % heads:
            divisors = [d for d in range(1, min(hidden[1], 64) + 1) if hidden[1] % d == 0]
            raise ConfigError(
                f"{prefix}{hidden[0]} {hidden[1]} in {source} is not a multiple of {prefix}{name} {heads}: each head "
                f"takes an equal share of the width; choose heads dividing it (e.g. {', '.join(map(str, divisors))}) "
                "or a width divisible by the heads"
            )
    kv = _first(values, KV_HEADS)
    heads = _first(values, HEADS[:4])
    if kv and heads and (kv[1] > heads[1] or heads[1] % kv[1]):
        raise ConfigError(
            f"{prefix}{kv[0]} {kv[1]} in {source} does not divide {prefix}{heads[0]} {heads[1]}: each key/value head "
            "serves an equal group of query heads; choose a divisor of the heads (equal to it for plain attention)"
        )


def parameters_at_least(values: Mapping[str, Any]) -> int:
    """A lower bound on the parameters ``values`` describe: per layer the query and output projections and two MLP
    matrices, plus the input embedding (architectures add more; none has less)."""
    hidden = (_first(values, HIDDEN) or ("", 0))[1]
    layers = max((value for name in LAYERS if (value := (_first(values, (name,)) or ("", 0))[1]) > 0), default=0)
    heads, head = _first(values, HEADS), _first(values, HEAD_WIDTH)
    attention = heads[1] * head[1] if heads and head else hidden if heads else 0
    inner = (_first(values, INTERMEDIATE) or ("", 0))[1]
    vocab = (_first(values, ("vocab_size",)) or ("", 0))[1]
    return layers * (2 * hidden * attention + 2 * hidden * inner) + vocab * hidden


def _sub_configs(values: Mapping[str, Any], prefix: str) -> list[tuple[str, Mapping[str, Any]]]:
    """``values`` and the configs nested in it (``text_config``, ``encoder`` …: mappings naming a model_type)."""
    found, stack = [], [(prefix, values)]
    while stack:
        where, config = stack.pop()
        found.append((where, config))
        for key, value in config.items():
            if isinstance(value, Mapping) and "model_type" in value:
                stack.append((f"{where}{key}.", value))
    return found


def check_config_values(values: Mapping[str, Any], source: str) -> None:
    """ConfigError (one line) unless every size in ``values`` (a config.json's mapping, nested configs included)
    is in range, the heads divide the width and the described model has at most :data:`MAX_PARAMETERS`."""
    total = 0
    for prefix, config in _sub_configs(values, ""):
        for name, value in config.items():
            if name in RANGES and value is not None:
                _check_range(prefix + name, value, source)
        _check_heads(config, prefix, source)
        total += parameters_at_least(config)
    if total > MAX_PARAMETERS:
        raise ConfigError(
            f"{source} describes at least {total:.3g} parameters (layers x attention and MLP widths + vocabulary x "
            f"hidden), more than the {MAX_PARAMETERS:.0e} trainer_ext builds; lower the layers, widths or vocabulary"
        )


def check_model_config(config: transformers.PretrainedConfig, source: str) -> None:
    """ConfigError (one line: field, file, valid range, fix) unless ``config``'s sizes are in range; see module doc."""
    values = config.to_dict()
    values["num_labels"] = getattr(config, "num_labels", None)  # a property (the id2label entries), not in to_dict
    check_config_values(values, source)


# what transformers raises on values it cannot take (its strict dataclass checks, __post_init__ arithmetic)
def _reading_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub.errors import StrictDataclassError

    return (ValueError, TypeError, KeyError, AttributeError, ArithmeticError, RecursionError, StrictDataclassError)


def load_model_config(
    name: str, what: str = "--model_config", trust_remote_code: bool = False
) -> transformers.PretrainedConfig:
    """The config at ``name`` (a config.json, a folder holding one, or a hub id), its values checked before
    transformers reads them and again after; ConfigError (one line) otherwise. ``what`` names the flag."""
    path = os.path.expanduser(name)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    source = f"{what} {file if os.path.exists(file) else name}"
    if os.path.exists(file):
        try:
            values = load_mapping(file, what, fmt=JSON)
        except ConfigError:
            raise
        except ValueError as error:  # json's own limits, e.g. an integer of more than 4,300 digits
            raise ConfigError(f"{source} is not valid JSON: {' '.join(str(error).split())[:200]}") from None
        check_config_values(values, source)
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, *_reading_errors()) as error:
        words = " ".join(str(error).split())[:300] or type(error).__name__
        hint = "" if isinstance(error, OSError) else "; fix the value it names"
        raise ConfigError(f"{source} cannot be read as a model config: {words}{hint}") from None
    check_model_config(config, source)
    return config


def check_job_config(args: Any) -> transformers.PretrainedConfig | None:
    """The config of a job's ``--model_name_or_path`` or ``--model_config`` file, checked by
    :func:`load_model_config` before the data is read or anything built; None for a preset (check it once sized)."""
    from trainer_ext.job.fields import PRESETS

    if args.model_name_or_path:
        return load_model_config(args.model_name_or_path, "--model_name_or_path", args.trust_remote_code)
    if args.model_config and args.model_config not in PRESETS:
        return load_model_config(args.model_config)
    return None
