"""How a global batch is divided among the processes: the ``split_batches`` rule."""

from __future__ import annotations

from ..errors import ConfigError


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
