"""accelerate's ``FullyShardedDataParallelPlugin`` for hand-written loops, read into our FSDP2 settings.

A loop written for accelerate configures FSDP with this plugin (``Accelerator(fsdp_plugin=...)``); it takes the
same fields. trainer_ext trains FSDP2 (``fully_shard``) only: the fields are turned into :class:`FSDPSettings`,
and after construction they hold the torch objects accelerate's FSDP2 plugin holds (``StateDictType``, an offload
policy, a ``MixedPrecisionPolicy``, torch's wrap policy function), so code that reads them back sees the same.
A field left ``None`` takes the FSDP settings ``trainer-ext launch --fsdp_config`` gave the script, as
accelerate's plugin takes ``accelerate launch``'s ``FSDP_*`` variables, and accelerate's FSDP2 default otherwise.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer_ext.distributed.strategies.fsdp.config import FSDPSettings, launched_fsdp_settings, parse_fsdp
from trainer_ext.errors import ConfigError
from trainer_ext.values import parse_bool

_DTYPES = {"fp8": "bfloat16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # accelerate's mapping
_TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
logger = logging.getLogger(__name__)
_FSDP1_ONLY = ("backward_prefetch", "use_orig_params", "sync_module_states", "param_init_fn")


def _dtype_name(value: Any, what: str) -> str:
    if isinstance(value, torch.dtype) and value in _TORCH_DTYPES:
        return _TORCH_DTYPES[value]
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    if isinstance(value, str) and value.replace("torch.", "") in _TORCH_DTYPES.values():
        return value.replace("torch.", "")
    raise ConfigError(
        f"FullyShardedDataParallelPlugin: invalid {what} {value!r}; use one of {list(_DTYPES)} or torch.bfloat16, "
        "torch.float16, torch.float32"
    )


def _offloads(value: Any) -> bool:
    """``cpu_offload`` as a bool, an FSDP1 ``CPUOffload(offload_params=...)`` or an FSDP2 offload policy."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(value, str):
        return parse_bool(value, "FullyShardedDataParallelPlugin: cpu_offload")
    if isinstance(value, CPUOffloadPolicy) or hasattr(value, "offload_params"):
        return bool(getattr(value, "offload_params", True))
    return bool(value) if isinstance(value, bool) else False


def _wrap_policy_name(policy: Any) -> str:
    """accelerate's wrap policy names, or torch's policy functions (as accelerate turns the names into), as ours."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    function = policy.func if isinstance(policy, functools.partial) else policy
    if function is transformer_auto_wrap_policy:
        return "transformer"
    if function is size_based_auto_wrap_policy:
        return "size"
    if isinstance(policy, str):
        return policy  # parse_fsdp checks the name
    raise ConfigError(
        "FullyShardedDataParallelPlugin: auto_wrap_policy must be 'transformer_based_wrap', 'size_based_wrap', "
        f"'no_wrap' or torch's transformer/size policy function, got {policy!r}; trainer_ext wraps by layer class "
        "(transformer_cls_names_to_wrap) or by size (min_num_params)"
    )


@dataclass
class FullyShardedDataParallelPlugin:
    """FSDP settings for ``Accelerator(fsdp_plugin=...)``, with accelerate's fields; trained as FSDP2."""

    fsdp_version: int | None = field(default=None, metadata={"help": "2 (FSDP2, the only one trainer_ext has)."})
    sharding_strategy: Any = field(default=None, metadata={"help": "Deprecated: FULL_SHARD, SHARD_GRAD_OP, ..."})
    reshard_after_forward: Any = field(default=None, metadata={"help": "Free the parameters after forward."})
    backward_prefetch: Any = field(default=None, metadata={"help": "FSDP1 only: ignored, as accelerate does."})
    mixed_precision_policy: Any = field(
        default=None, metadata={"help": "'bf16'/'fp16'/'fp32', a dict of dtypes, or a MixedPrecisionPolicy."}
    )
    auto_wrap_policy: Any = field(
        default=None, metadata={"help": "transformer_based_wrap, size_based_wrap or no_wrap (default)."}
    )
    cpu_offload: Any = field(default=None, metadata={"help": "Keep parameters and optimizer state on the CPU."})
    ignored_modules: Any = field(default=None, metadata={"help": "Not supported by trainer_ext."})
    state_dict_type: Any = field(default=None, metadata={"help": "SHARDED_STATE_DICT (default) or FULL_STATE_DICT."})
    state_dict_config: Any = field(default=None, metadata={"help": "Kept as given; checkpoints are always DCP."})
    optim_state_dict_config: Any = field(default=None, metadata={"help": "Kept as given."})
    limit_all_gathers: bool = field(default=True, metadata={"help": "FSDP1 only: ignored."})
    use_orig_params: bool | None = field(default=None, metadata={"help": "FSDP1 only: ignored."})
    param_init_fn: Any = field(default=None, metadata={"help": "FSDP1 only: ignored."})
    sync_module_states: bool | None = field(default=None, metadata={"help": "FSDP1 only: ignored."})
    forward_prefetch: bool | None = field(default=None, metadata={"help": "Not implemented in FSDP2."})
    activation_checkpointing: bool | None = field(default=None, metadata={"help": "Recompute each layer."})
    activation_checkpointing_offload: bool | None = field(default=None, metadata={"help": "Not supported."})
    cpu_ram_efficient_loading: bool | None = field(default=None, metadata={"help": "Accepted; no effect."})
    transformer_cls_names_to_wrap: list[str] | str | None = field(
        default=None, metadata={"help": "Layer classes to shard one by one (default: _no_split_modules)."}
    )
    min_num_params: int | None = field(default=None, metadata={"help": "Size threshold of size_based_wrap."})

    def __post_init__(self) -> None:
        launched = launched_fsdp_settings() or {}
        explicit_version = self.fsdp_version is not None
        if self.fsdp_version is None:
            self.fsdp_version = 2  # accelerate's default is FSDP1; ours trains FSDP2 whatever the version left unset
        if int(self.fsdp_version) != 2:
            raise ConfigError(
                f"FullyShardedDataParallelPlugin(fsdp_version={self.fsdp_version}): trainer_ext trains with FSDP2 "
                "(torch.distributed.fsdp.fully_shard) only; pass fsdp_version=2"
            )
        self.fsdp_version = 2
        if self.forward_prefetch or (explicit_version and self.forward_prefetch is not None):
            raise ConfigError("forward_prefetch is not yet implemented in FSDP2, set to None or use `fsdp_version=1`")
        if explicit_version and self.sharding_strategy is not None and self.reshard_after_forward is None:
            raise ConfigError(  # accelerate's FSDP2 reads reshard_after_forward only
                "reshard_after_forward set to None. This is not supported with FSDP2, please set to a `bool`: "
                "sharding_strategy is FSDP1's; pass reshard_after_forward=True (FULL_SHARD) or False (SHARD_GRAD_OP)"
            )
        if self.activation_checkpointing_offload:
            raise ConfigError(
                "FullyShardedDataParallelPlugin: activation_checkpointing_offload is not supported by trainer_ext; "
                "use activation_checkpointing=True alone"
            )
        if self.ignored_modules is not None:
            raise ConfigError(
                "FullyShardedDataParallelPlugin: ignored_modules is not supported by trainer_ext; every parameter "
                "is sharded"
            )
        for name in _FSDP1_ONLY:
            setattr(self, name, None)  # accelerate drops them for FSDP2 (with a warning)
        self._settings = parse_fsdp(True, self._raw_config(launched))
        self._show(self._settings)

    def _raw_config(self, launched: dict[str, Any]) -> dict[str, Any]:
        """The fields as ``fsdp_config`` keys; a field left None takes the launch's value, else accelerate's."""
        # the launch's settings are whole (unset keys mean FSDPSettings' defaults); accelerate's own default is NO_WRAP
        raw: dict[str, Any] = dict(launched) if launched else {"auto_wrap_policy": "no_wrap"}
        if self.sharding_strategy is not None:
            strategy = getattr(self.sharding_strategy, "name", self.sharding_strategy)
            raw["sharding_strategy"] = str(strategy)
            raw.pop("reshard_after_forward", None)
            raw.pop("hybrid_shard", None)
        if self.reshard_after_forward is not None:
            value = self.reshard_after_forward
            if not isinstance(value, bool | str):
                raise ConfigError(
                    f"reshard_after_forward set to {value}. This is not supported with FSDP2, please set to a `bool`"
                )
            raw["reshard_after_forward"] = value
        if self.cpu_offload is not None:
            raw["cpu_offload"] = _offloads(self.cpu_offload)
        if self.auto_wrap_policy is not None:
            raw["auto_wrap_policy"] = _wrap_policy_name(self.auto_wrap_policy)
        if self.transformer_cls_names_to_wrap is not None:
            raw["transformer_layer_cls_to_wrap"] = self.transformer_cls_names_to_wrap
        if self.min_num_params is not None:
            if not isinstance(self.min_num_params, int):
                raise ConfigError(
                    f"`min_num_params` must be an integer. Got {self.min_num_params} of type "
                    f"{type(self.min_num_params)}"
                )
            raw["min_num_params"] = self.min_num_params
        if self.activation_checkpointing is not None:
            raw["activation_checkpointing"] = bool(self.activation_checkpointing)
        raw.update(self._precision())
        return raw

    def _precision(self) -> dict[str, Any]:
        policy = self.mixed_precision_policy
        if policy is None:
            return {}
        if isinstance(policy, str):
            dtype = _dtype_name(policy, "mixed_precision_policy")
            return {"param_dtype": dtype, "reduce_dtype": dtype}
        if isinstance(policy, dict):
            return {k: _dtype_name(v, k) for k, v in policy.items() if k in ("param_dtype", "reduce_dtype")}
        found = {k: getattr(policy, k, None) for k in ("param_dtype", "reduce_dtype")}
        return {k: _dtype_name(v, k) for k, v in found.items() if v is not None}

    def _show(self, settings: FSDPSettings) -> None:
        """The fields as accelerate's FSDP2 plugin holds them after construction (torch objects)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

        self.reshard_after_forward = settings.reshard_after_forward
        self.cpu_offload = CPUOffloadPolicy() if settings.cpu_offload else OffloadPolicy()
        self.activation_checkpointing = settings.activation_checkpointing
        self.activation_checkpointing_offload = False
        self.auto_wrap_policy = {"transformer": transformer_auto_wrap_policy, "size": size_based_auto_wrap_policy}.get(
            settings.auto_wrap_policy
        )
        if settings.auto_wrap_policy == "transformer" and settings.transformer_layer_cls_to_wrap is not None:
            self.transformer_cls_names_to_wrap = list(settings.transformer_layer_cls_to_wrap)
        if settings.auto_wrap_policy == "size":
            self.min_num_params = settings.min_num_params
        self.set_state_dict_type(self.state_dict_type)
        if self.state_dict_type.name == "FULL_STATE_DICT":
            logger.warning(
                "FullyShardedDataParallelPlugin(state_dict_type=FULL_STATE_DICT): trainer_ext's save_state writes "
                "sharded (DCP) checkpoints; get_state_dict and save_model give the whole model either way"
            )
        if settings.param_dtype is not None or settings.reduce_dtype is not None:
            dtypes = {"param_dtype": settings.param_dtype, "reduce_dtype": settings.reduce_dtype}
            self.mixed_precision_policy = MixedPrecisionPolicy(
                **{k: getattr(torch, v) for k, v in dtypes.items() if v is not None}
            )
        if self.cpu_ram_efficient_loading is None:
            self.cpu_ram_efficient_loading = False

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """accelerate's method: the state dict type ``get_state_dict``/``save_model`` use (SHARDED by default for
        FSDP2), and the configs accelerate fills in for it. trainer_ext's checkpoints are always sharded (DCP) and
        ``get_state_dict`` always gathers the whole model, so the type is kept for code that reads it back."""
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )

        value = state_dict_type if state_dict_type is not None else "SHARDED_STATE_DICT"
        if isinstance(value, str):
            value = StateDictType(int(value)) if value.isdigit() else StateDictType[value.upper()]
        if value == StateDictType.LOCAL_STATE_DICT:
            raise ConfigError(
                "FSDP2 does not support LOCAL_STATE_DICT. Please set `fsdp_state_dict_type` to `SHARDED_STATE_DICT` "
                "or `FULL_STATE_DICT`."
            )
        self.state_dict_type = value
        full = value == StateDictType.FULL_STATE_DICT
        if self.state_dict_config is None:
            self.state_dict_config = (
                FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                if full
                else ShardedStateDictConfig(offload_to_cpu=True)
            )
        if self.optim_state_dict_config is None:
            self.optim_state_dict_config = (
                FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
                if full
                else ShardedOptimStateDictConfig(offload_to_cpu=True)
            )

    @property
    def settings(self) -> FSDPSettings:
        """What the FSDP2 strategy applies."""
        return self._settings

    @classmethod
    def view(cls, settings: FSDPSettings) -> FullyShardedDataParallelPlugin:
        """The plugin accelerate would show for settings given as ``fsdp_config=`` (a preset path or a dict)."""
        plugin = cls.__new__(cls)
        for name, f in cls.__dataclass_fields__.items():
            setattr(plugin, name, f.default)
        plugin.fsdp_version = 2
        plugin._settings = settings
        plugin._show(settings)
        return plugin
