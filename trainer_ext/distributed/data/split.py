"""How work is divided among the processes: the ``split_batches`` rule, and a share of a list of inputs."""

from __future__ import annotations

from typing import Any

import torch

from trainer_ext.errors import ConfigError


def check_split(batch_size: int | None, num_processes: int, split_batches: bool) -> None:
    """``split_batches`` cuts each batch in ``num_processes`` equal parts: refuse a batch size that does not divide."""
    if not split_batches:
        return
    if batch_size is None:
        raise ConfigError(
            "split_batches=True needs a loader with a fixed batch size (batch_size=..., or a batch_sampler with a "
            "batch_size attribute); set one or turn split_batches off"
        )
    if batch_size % num_processes:
        raise ConfigError(
            f"split_batches=True cuts each batch of {batch_size} samples into {num_processes} equal parts, one per "
            f"process: make the batch size a multiple of {num_processes} (per_device_train_batch_size / "
            "per_device_eval_batch_size or the DataLoader's batch_size), or turn split_batches off"
        )


def share_of(inputs: Any, processes: int, index: int, pad: bool) -> Any:
    """Process ``index``'s contiguous share of a list, tuple, tensor, ``datasets.Dataset`` or dict of them (accelerate's
    ``split_between_processes``): the first ``len % processes`` get one more; ``pad`` repeats the last element."""
    if isinstance(inputs, dict):
        lengths = {len(value) for value in inputs.values()}
        if len(lengths) > 1:
            raise ValueError("All values in the dictionary must have the same length")
        return {key: share_of(value, processes, index, pad) for key, value in inputs.items()}
    per, extra = divmod(len(inputs), processes)
    start = index * per + min(index, extra)
    end = start + per + int(index < extra)
    most = per + int(extra > 0)
    if _is_dataset(inputs):
        rows = list(range(min(start, len(inputs)), min(end, len(inputs))))
        if pad:
            rows += [len(inputs) - 1] * (most - len(rows))
        return inputs.select(rows)
    if not isinstance(inputs, (list, tuple, torch.Tensor)):
        raise TypeError(
            f"split_between_processes splits a list, tuple, tensor, datasets.Dataset or a dict of them, not "
            f"{type(inputs).__name__}"
        )
    part = inputs[start:end]
    if not pad or len(part) == most:
        return part
    if isinstance(inputs, torch.Tensor):
        filler = inputs[-1:].expand(most - len(part), *inputs.shape[1:])
        return torch.cat([part, filler])
    return part + type(part)([inputs[-1]] * (most - len(part)))


def _is_dataset(inputs: Any) -> bool:
    try:
        from datasets import Dataset
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(inputs, Dataset)
