"""Device memory helpers (accelerate.utils.memory's names): free cached memory, and tell an out-of-memory error.

The Trainer installs them where transformers expects accelerate's, and the loops' batch-size finder uses them.
"""

from __future__ import annotations

import gc
from typing import Any

import torch


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Free cached accelerator memory (``torch_empty_cache_steps``)."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif hasattr(torch, "mps") and torch.backends.mps.is_available():
        torch.mps.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Drop references and free cached memory; returns ``None`` for each object passed."""
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    clear_device_cache(garbage_collection=True)
    return objects


def should_reduce_batch_size(exception: Exception) -> bool:
    """True when ``exception`` is an out-of-memory error."""
    messages = (
        "CUDA out of memory.",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
        "DefaultCPUAllocator: can't allocate memory",
        "out of memory",
    )
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    return (
        isinstance(exception, RuntimeError)
        and len(exception.args) == 1
        and any(m in exception.args[0] for m in messages)
    )
