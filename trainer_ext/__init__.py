"""trainer_ext: HF-compatible fine-tuning from one CPU to many nodes, without the accelerate package.

Public names load lazily, so ``import trainer_ext`` stays cheap and never imports optional backends.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Trainer": "trainer_ext.trainer",
    "adapt": "trainer_ext.foreign_trainers",
    "TrainingArguments": "trainer_ext.training_args",
    "Seq2SeqTrainer": "trainer_ext.seq2seq",
    "Seq2SeqTrainingArguments": "trainer_ext.seq2seq",
    "Accelerator": "trainer_ext.accelerator",
    "DistributedType": "trainer_ext.distributed.state",
    "ProjectConfiguration": "trainer_ext.accelerator_options",
    "DataLoaderConfiguration": "trainer_ext.accelerator_options",
    "GradientAccumulationPlugin": "trainer_ext.accelerator_options",
    "KwargsHandler": "trainer_ext.accelerator_options",
    "DistributedDataParallelKwargs": "trainer_ext.accelerator_options",
    "DDPCommunicationHookType": "trainer_ext.accelerator_options",
    "GradScalerKwargs": "trainer_ext.accelerator_options",
    "InitProcessGroupKwargs": "trainer_ext.accelerator_options",
    "AutocastKwargs": "trainer_ext.accelerator_options",
    "ProfileKwargs": "trainer_ext.accelerator_options",
    "DeepSpeedPlugin": "trainer_ext.distributed.deepspeed_plugin",
    "DummyOptim": "trainer_ext.distributed.deepspeed_plugin",
    "DummyScheduler": "trainer_ext.distributed.deepspeed_plugin",
    "FullyShardedDataParallelPlugin": "trainer_ext.distributed.fsdp_plugin",
    "LocalSGD": "trainer_ext.local_sgd",
    "find_executable_batch_size": "trainer_ext.loop_helpers",
    "set_seed": "trainer_ext.loop_helpers",
    "get_logger": "trainer_ext.loop_helpers",
    "Engine": "trainer_ext.distributed.engine",
    "DistState": "trainer_ext.distributed.state",
    "ConfigError": "trainer_ext.errors",
    "train": "trainer_ext.api",
    "ModelArguments": "trainer_ext.arguments",
    "DataArguments": "trainer_ext.arguments",
    "TrainJobArguments": "trainer_ext.arguments",
    "infer_auto_device_map": "trainer_ext.dispatch",
    "dispatch_model": "trainer_ext.dispatch",
    "load_checkpoint_and_dispatch": "trainer_ext.dispatch",
    "init_empty_weights": "trainer_ext.dispatch",
    "dispatch_summary": "trainer_ext.dispatch",
    "gather_object": "trainer_ext.distributed.collectives",
    "skip_first_batches": "trainer_ext.distributed.data",
}
# accelerate.utils' checks of what this machine has (a light module: standard library only until a check runs)
from .availability import __all__ as _AVAILABILITY  # noqa: E402

_EXPORTS.update(dict.fromkeys(_AVAILABILITY, "trainer_ext.availability"))

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_ext' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
