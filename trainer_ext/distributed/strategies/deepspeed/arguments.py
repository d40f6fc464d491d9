"""What transformers' ``--deepspeed`` becomes: the config read, checked and resolved from the arguments, and
registered with transformers (``is_deepspeed_zero3_enabled()``, ZeRO-3 ``from_pretrained``)."""

from __future__ import annotations

import functools
import os
from typing import Any

from trainer_ext.distributed.strategies.deepspeed import config as deepspeed_config
from trainer_ext.distributed.strategies.deepspeed.config import DeepSpeedConfig, DeepSpeedInputs
from trainer_ext.distributed.strategies.deepspeed.setup import start_communication


def config_from_training_args(args: Any) -> DeepSpeedConfig:
    """Read ``args.deepspeed``, resolve its ``"auto"`` values from ``args`` and register it with transformers.

    Registering makes ``is_deepspeed_zero3_enabled()`` true under ZeRO-3, so ``from_pretrained`` called after the
    arguments were built creates the model partitioned; DeepSpeed's communication starts on transformers' first
    ZeRO-3 query. Keep the returned config alive meanwhile (transformers holds a weak reference).
    """
    if args.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: it picks its device once
    config = DeepSpeedConfig(args.deepspeed).resolve(DeepSpeedInputs.from_training_args(args, args.world_size))
    hook = functools.partial(start_communication, args.distributed_state, False)
    deepspeed_config.register_with_transformers(config, on_first_zero3_query=hook)
    return config
