"""Folders in the layout accelerate 1.15's ``save_state`` writes, made with torch and safetensors directly.

accelerate is not installable in this environment, so these mirror its ``checkpointing.save_accelerator_state`` and
``save_custom_state``: the same file names (``model.safetensors`` or ``pytorch_model.bin``, ``optimizer.bin``,
``scheduler.bin``, ``random_states_<rank>.pkl``, ``custom_checkpoint_<i>.pkl``) and the same contents (state dicts
through ``torch.save``; the random states as the dict accelerate pickles). The parity test
(``tests/accelerator_parity/test_migrate_from_accelerate.py``) loads folders written by accelerate itself.
"""

from __future__ import annotations

import pathlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file


class Touch:
    """Unpickled in full, it creates ``path``: the stand-in for any code a crafted file could run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


class Counter:
    """A registered object (``register_for_checkpointing``) with a tensor and a number in its state."""

    def __init__(self, count: int = 0) -> None:
        self.count, self.seen = count, torch.zeros(2)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.seen = state["count"], state["seen"]


def random_states(step: int = 0) -> dict[str, Any]:
    """This process's generators as accelerate pickles them (CPU: python, numpy, torch)."""
    return {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }


def write(
    folder: Path,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any = None,
    custom: tuple[Any, ...] = (),
    *,
    safe: bool = True,
    prefix: str = "",
    processes: int = 1,
    step: int = 0,
) -> Path:
    """``folder`` as accelerate's ``save_state(folder, safe_serialization=safe)`` leaves it; ``prefix`` as the
    prepared model names its tensors (``"module."`` under DDP), every process's random states the current ones."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = {prefix + name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    if safe:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(weights, folder / "pytorch_model.bin")
    torch.save(optimizer.state_dict(), folder / "optimizer.bin")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), folder / "scheduler.bin")
    for rank in range(processes):
        torch.save(random_states(step), folder / f"random_states_{rank}.pkl")
    for i, obj in enumerate(custom):
        torch.save(obj.state_dict(), folder / f"custom_checkpoint_{i}.pkl")
    return folder
