"""FSDP2 settings from ``--fsdp`` and ``--fsdp_config``: YAML or JSON, transformers' or accelerate's key names.

One normal form (:class:`FSDPSettings`) whatever the source: transformers' ``fsdp_config`` JSON keys, the
``fsdp_``-prefixed keys of an accelerate config file (also a whole accelerate YAML with an ``fsdp_config:``
block), and the legacy ``--fsdp "full_shard auto_wrap offload"`` words. Unknown keys are errors (a typo must
not silently train unsharded); FSDP1-only keys are ignored with a warning that :func:`read_fsdp_settings`
returns (the launcher shows it as a dry-run note) and :func:`parse_fsdp` logs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from trainer_ext.config_files import JSON, load_mapping, parse_mapping
from trainer_ext.env_vars import FSDP_CONFIG as _ENV_FSDP
from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.values import TRUE_WORDS, parse_bool

logger = logging.getLogger(__name__)

WRAP_POLICIES = ("transformer", "size", "none")
_WRAP_ALIASES = {
    "transformer_based_wrap": "transformer",
    "transformer": "transformer",
    "size_based_wrap": "size",
    "size": "size",
    "no_wrap": "none",
    "none": "none",
}
# accelerate's sharding strategies (names, or the numbers its config files use) -> (reshard, hybrid)
_STRATEGIES = {
    "full_shard": (True, False),
    "shard_grad_op": (False, False),
    "hybrid_shard": (True, True),
    "hybrid_shard_zero2": (False, True),
    "_hybrid_shard_zero2": (False, True),
    "1": (True, False),
    "2": (False, False),
    "4": (True, True),
    "5": (False, True),
}
_FLAG_WORDS = {"full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap"}
_DTYPES = ("float32", "bfloat16", "float16")
# FSDP1 or XLA settings with no FSDP2 meaning (transformers fills in the xla ones itself)
_IGNORED = {
    "backward_prefetch",
    "forward_prefetch",
    "use_orig_params",
    "sync_module_states",
    "limit_all_gathers",
    "cpu_ram_efficient_loading",
    "xla_fsdp_v2",
    "xla_fsdp_grad_ckpt",
    "xla_fsdp_settings",
    "state_dict_type",
}


@dataclass(frozen=True)
class FSDPSettings:
    """How ``fully_shard`` is applied. Checkpoints are always sharded (DCP); the final model is consolidated."""

    reshard_after_forward: bool = True
    auto_wrap_policy: str = "transformer"
    transformer_layer_cls_to_wrap: tuple[str, ...] | None = None  # None: the model's _no_split_modules
    min_num_params: int = 100_000_000
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    hybrid_shard: bool = False
    replicate_size: int | None = None  # hybrid only; None: the number of machines
    param_dtype: str | None = None  # None: from --bf16/--fp16 (float32 otherwise)
    reduce_dtype: str | None = None  # None: float32

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.transformer_layer_cls_to_wrap is not None:
            out["transformer_layer_cls_to_wrap"] = list(self.transformer_layer_cls_to_wrap)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> FSDPSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in known}
        if kwargs.get("transformer_layer_cls_to_wrap") is not None:
            kwargs["transformer_layer_cls_to_wrap"] = tuple(kwargs["transformer_layer_cls_to_wrap"])
        return cls(**kwargs)


def _bool(key: str, value: Any) -> bool:
    return parse_bool(value, f"fsdp_config: {key}")


def _int(key: str, value: Any, minimum: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"fsdp_config: {key} must be a whole number, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"fsdp_config: {key} must be at least {minimum}, got {number}")
    return number


def read_fsdp_config(source: str | os.PathLike | dict | None) -> dict[str, Any]:
    """A raw ``fsdp_config`` dict from a YAML/JSON file path, a JSON string, or a dict (copied)."""
    if source is None:
        return {}
    if isinstance(source, dict):
        return dict(source)
    text = str(source).strip()
    if text.startswith("{"):
        data = parse_mapping(text, "inline --fsdp_config", fmt=JSON)
    else:
        data = load_mapping(text, "--fsdp_config", hint="; presets live in configs/fsdp/")
    if isinstance(data.get("fsdp_config"), dict):  # a whole accelerate config file
        data = data["fsdp_config"]
    return dict(data)


def _flag_words(fsdp: Any) -> list[str]:
    """The option words of ``--fsdp`` (``True``/``"true"`` → none, ``"full_shard offload"`` → two)."""
    if fsdp is True:
        return []
    words = [str(w).strip().lower() for w in fsdp] if isinstance(fsdp, (list, tuple)) else str(fsdp).lower().split()
    out = []
    for word in words:
        if word in TRUE_WORDS:
            continue
        if word == "no_shard":
            raise ConfigError("--fsdp no_shard replicates the whole model: drop --fsdp, several processes use DDP")
        if word not in _FLAG_WORDS:
            raise ConfigError(
                f"--fsdp: unknown option {word!r}; use --fsdp alone, or words from {sorted(_FLAG_WORDS)}."
                f"{did_you_mean(word, _FLAG_WORDS)}"
            )
        out.append(word)
    return out


def fsdp_requested(value: object) -> bool:
    """``--fsdp`` given: True, option words or a list; not None/False/""/a false word ("false", "no", "off" ...)."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return False
        try:
            return parse_bool(text)
        except ConfigError:
            return True  # option words: "full_shard offload"
    return bool(value)


def parse_fsdp(fsdp: Any, fsdp_config: str | os.PathLike | dict | None) -> FSDPSettings:
    """Settings from the ``--fsdp`` words and the ``--fsdp_config`` file; values in the file win.

    Warnings (FSDP1-only keys ignored) are logged; :func:`read_fsdp_settings` returns them instead.
    """
    settings, warnings = read_fsdp_settings(fsdp, fsdp_config)
    for warning in warnings:
        logger.warning("%s", warning)
    return settings


def read_fsdp_settings(fsdp: Any, fsdp_config: str | os.PathLike | dict | None) -> tuple[FSDPSettings, list[str]]:
    """:func:`parse_fsdp` without logging: the settings, and the warnings met while reading them."""
    raw = read_fsdp_config(fsdp_config)
    values: dict[str, Any] = {}
    for word in _flag_words(fsdp):
        if word in _STRATEGIES:
            values["reshard_after_forward"], values["hybrid_shard"] = _STRATEGIES[word]
        elif word == "offload":
            values["cpu_offload"] = True
    ignored = []
    fields = {f.name for f in dataclasses.fields(FSDPSettings)}
    accepted = fields | {"version", "sharding_strategy", "offload_params", "xla"} | _IGNORED
    for key, value in raw.items():
        name = str(key).lower()
        name = name[5:] if name.startswith("fsdp_") else name
        if name in ("version", "fsdp_version"):
            if str(value).strip() != "2":
                raise ConfigError(
                    f"fsdp_config: version {value!r} is not supported. FSDP1 is deprecated upstream and needs an "
                    "accelerator; trainer_ext trains with FSDP2 (torch.distributed.fsdp.fully_shard): set "
                    "`version: 2` or remove the key"
                )
        elif name == "xla":
            if _bool(name, value):
                raise ConfigError("fsdp_config: xla is not supported by trainer_ext (FSDP2 on CPU/CUDA only)")
        elif name == "sharding_strategy":
            strategy = str(value).strip().lower()
            if strategy in ("no_shard", "3"):
                raise ConfigError(
                    "fsdp_config: sharding_strategy NO_SHARD replicates the whole model: drop --fsdp, several "
                    "processes use DDP"
                )
            if strategy not in _STRATEGIES:
                raise ConfigError(
                    f"fsdp_config: unknown sharding_strategy {value!r}; use FULL_SHARD, SHARD_GRAD_OP, "
                    "HYBRID_SHARD or HYBRID_SHARD_ZERO2"
                )
            values["reshard_after_forward"], values["hybrid_shard"] = _STRATEGIES[strategy]
        elif name in ("cpu_offload", "offload_params"):
            values["cpu_offload"] = _bool(name, value)
        elif name in ("reshard_after_forward", "activation_checkpointing", "hybrid_shard"):
            values[name] = _bool(name, value)
        elif name == "auto_wrap_policy":
            policy = _WRAP_ALIASES.get(str(value).strip().lower())
            if policy is None:
                raise ConfigError(
                    f"fsdp_config: unknown auto_wrap_policy {value!r}; use TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP "
                    "or NO_WRAP"
                )
            values[name] = policy
        elif name == "transformer_layer_cls_to_wrap":
            names = value.split(",") if isinstance(value, str) else list(value or [])
            values[name] = tuple(n.strip() for n in names if str(n).strip()) or None
        elif name == "min_num_params":
            values[name] = _int(name, value, 0)
        elif name == "replicate_size":
            values[name] = _int(name, value, 1)
        elif name in ("param_dtype", "reduce_dtype"):
            dtype = str(value).strip().lower().replace("torch.", "")
            dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
            if dtype not in _DTYPES:
                raise ConfigError(f"fsdp_config: {name} must be one of {', '.join(_DTYPES)}, got {value!r}")
            values[name] = dtype
        elif name in _IGNORED:
            if name.startswith("xla") or (name == "state_dict_type" and "SHARDED" in str(value).upper()):
                continue
            ignored.append(str(key))
        else:
            raise ConfigError(f"fsdp_config: unknown key {key!r}.{did_you_mean(name, accepted)}")
    if values.get("min_num_params") and "auto_wrap_policy" not in values:
        values["auto_wrap_policy"] = "size"  # a size threshold alone means size-based wrapping
    warnings = []
    if ignored:
        warnings.append(
            f"fsdp_config: ignoring {', '.join(sorted(ignored))} (FSDP1-only or not applicable to FSDP2; checkpoints "
            "are always sharded and the final model is saved consolidated)"
        )
    return FSDPSettings(**values), warnings


def normalized_config(settings: FSDPSettings) -> dict[str, Any]:
    """``args.fsdp_config`` as transformers' Trainer reads it (its ``xla`` keys) plus our settings."""
    return {"xla": False, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False, **settings.to_dict()}


def launched_fsdp_settings() -> dict[str, Any] | None:
    """The FSDP settings ``trainer-ext launch --fsdp_config`` exported to this script (our key names), or None."""
    text = os.environ.get(_ENV_FSDP)
    if not text:
        return None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        values = error
    if not isinstance(values, dict):  # a JSON object of FSDP keys, nothing else
        raise ConfigError(f"{_ENV_FSDP} is not the JSON object trainer-ext launch writes ({values}); unset it")
    return values
