"""What transformers' ``--fsdp``/``--fsdp_config`` become (YAML or JSON; transformers' or accelerate's keys)."""

from __future__ import annotations

from typing import Any

from trainer_ext.distributed.strategies.fsdp.config import normalized_config, parse_fsdp
from trainer_ext.errors import ConfigError


def plugin_args_from_training_args(args: Any) -> dict[str, Any]:
    """Read ``args.fsdp``/``args.fsdp_config`` (which must ask for FSDP), normalise them on ``args`` and return the
    settings as transformers' ``fsdp_plugin_args``."""
    settings = parse_fsdp(args.fsdp, args.fsdp_config)
    if settings.activation_checkpointing and (
        getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)
    ):
        raise ConfigError(
            "fsdp_config activation_checkpointing and --gradient_checkpointing both recompute activations; "
            "keep only fsdp_config activation_checkpointing (it recomputes each layer without a second all-gather)"
        )
    args.fsdp = True
    args.fsdp_config = normalized_config(settings)
    return settings.to_dict()
