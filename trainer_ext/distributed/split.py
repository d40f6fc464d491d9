"""How a global batch is divided among the processes: the ``split_batches`` rule and each rank's rows."""

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


def rank_rows(n: int, short: bool, num_processes: int, process_index: int, cap: int) -> tuple[slice, int, int]:
    """This rank's rows of a global batch of ``n`` rows: (real rows, padding rows, offset into the padding).

    A full batch is cut in ``num_processes`` equal slices. A short one gives each rank ``min(n, cap)`` rows in
    rank order; the positions past ``n`` are padding, taken cyclically from the epoch's first rows.
    """
    if not short:
        per = n // num_processes
        return slice(process_index * per, (process_index + 1) * per), 0, 0
    per = min(n, cap)
    start, stop = process_index * per, (process_index + 1) * per
    real = slice(min(start, n), min(stop, n))
    return real, max(0, stop - max(start, n)), max(0, start - n)
