"""trainer_ext: HF-compatible fine-tuning from one CPU to many nodes, without the accelerate package.

Public names load lazily, so ``import trainer_ext`` stays cheap and never imports optional backends.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Trainer": "trainer_ext.trainer.trainer",
    "adapt": "trainer_ext.trainer.adapt",
    "TrainingArguments": "trainer_ext.trainer.training_args",
    "Seq2SeqTrainer": "trainer_ext.trainer.seq2seq",
    "Seq2SeqTrainingArguments": "trainer_ext.trainer.seq2seq",
    "Accelerator": "trainer_ext.accelerator.accelerator",
    "DistributedType": "trainer_ext.distributed.state",
    "ProjectConfiguration": "trainer_ext.accelerator.options",
    "DataLoaderConfiguration": "trainer_ext.accelerator.options",
    "GradientAccumulationPlugin": "trainer_ext.accelerator.options",
    "KwargsHandler": "trainer_ext.accelerator.options",
    "DistributedDataParallelKwargs": "trainer_ext.accelerator.options",
    "DDPCommunicationHookType": "trainer_ext.accelerator.options",
    "GradScalerKwargs": "trainer_ext.accelerator.options",
    "InitProcessGroupKwargs": "trainer_ext.accelerator.options",
    "AutocastKwargs": "trainer_ext.accelerator.options",
    "ProfileKwargs": "trainer_ext.accelerator.options",
    "DeepSpeedPlugin": "trainer_ext.distributed.strategies.deepspeed.plugin",
    "DummyOptim": "trainer_ext.distributed.strategies.deepspeed.plugin",
    "DummyScheduler": "trainer_ext.distributed.strategies.deepspeed.plugin",
    "FullyShardedDataParallelPlugin": "trainer_ext.distributed.strategies.fsdp.plugin",
    "ParallelismConfig": "trainer_ext.distributed.mesh.config",
    "TorchTensorParallelConfig": "trainer_ext.distributed.mesh.config",
    "context_parallel_batch": "trainer_ext.accelerator.context_parallel",
    "pipeline_step": "trainer_ext.accelerator.pipeline",
    "pipeline_eval_step": "trainer_ext.accelerator.pipeline",
    "LocalSGD": "trainer_ext.accelerator.local_sgd",
    "find_executable_batch_size": "trainer_ext.accelerator.loop_helpers",
    "set_seed": "trainer_ext.accelerator.loop_helpers",
    "get_logger": "trainer_ext.accelerator.loop_helpers",
    "Engine": "trainer_ext.distributed.engine",
    "DistState": "trainer_ext.distributed.state",
    "ConfigError": "trainer_ext.errors",
    "train": "trainer_ext.job.run",
    "ModelArguments": "trainer_ext.job.arguments",
    "DataArguments": "trainer_ext.job.arguments",
    "TrainJobArguments": "trainer_ext.job.arguments",
    "infer_auto_device_map": "trainer_ext.inference",
    "dispatch_model": "trainer_ext.inference",
    "load_checkpoint_and_dispatch": "trainer_ext.inference",
    "init_empty_weights": "trainer_ext.inference",
    "dispatch_summary": "trainer_ext.inference",
    "gather_object": "trainer_ext.distributed.collectives",
    "skip_first_batches": "trainer_ext.distributed.data.loader",
}
# accelerate.utils' checks of what this machine has (a light module: standard library only until a check runs)
from trainer_ext.accelerator.availability import __all__ as _AVAILABILITY  # noqa: E402

_EXPORTS.update(dict.fromkeys(_AVAILABILITY, "trainer_ext.accelerator.availability"))

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
