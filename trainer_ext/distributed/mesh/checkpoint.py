"""Checkpoints of a model sharded over an N-D mesh (tensor-parallel, sharded, or both): model and optimizer saved
with ``torch.distributed.checkpoint`` by every rank, loaded resharded onto whatever mesh the loading job has
(another layout, another number of processes, or one process with no process group), and the consolidated
export that ``from_pretrained`` reads on one process.

The files are those of :mod:`trainer_ext.checkpointing.sharded` (``model_sharded/``, ``optimizer_sharded/``,
tensors keyed by parameter name with their full shapes), read through its allow-listed reader: a checkpoint
written under tensor parallelism and one written by FSDP2 are the same format and load into each other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer_ext.checkpointing import sharded
from trainer_ext.errors import ConfigError

if TYPE_CHECKING:
    import torch


def save_sharded(model: torch.nn.Module, optimizer: Any, directory: str | os.PathLike) -> None:
    """Every rank writes its shards of ``model`` (and of ``optimizer``'s state, unless None) under ``directory``
    (a collective on the default process group)."""
    sharded.save_model(model, directory)
    if optimizer is not None:
        sharded.save_optimizer(model, optimizer, directory)


def load_sharded(model: torch.nn.Module, optimizer: Any, directory: str | os.PathLike) -> None:
    """Load what :func:`save_sharded` wrote into ``model`` (and ``optimizer``, unless None), resharded to this
    job's layout; a checkpoint of another model, or one without the optimizer asked for, is refused first."""
    path = Path(directory)
    if not sharded.has_sharded_model(path):
        raise ConfigError(
            f"{path} holds no sharded model checkpoint ({sharded.MODEL_DIR}/ is missing): "
            f"pass the folder save_sharded wrote"
        )
    if optimizer is not None and not sharded.has_sharded_optimizer(path):
        raise ConfigError(
            f"{path} holds the model but not the optimizer ({sharded.OPTIMIZER_DIR}/ is missing): "
            f"pass optimizer=None to load the weights only, or pick a checkpoint saved with its optimizer"
        )
    sharded.load_model(model, path)
    if optimizer is not None:
        sharded.load_optimizer(model, optimizer, path)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict (every DTensor gathered whole) on the CPU of rank 0, empty on the other ranks; call it
    on every rank."""
    return sharded.full_state_dict(model)


def export_pretrained(
    model: torch.nn.Module, directory: str | os.PathLike, *, max_shard_size: str | int = "5GB"
) -> dict[str, int]:
    """Rank 0 writes the whole model as safetensors with its config, loadable by ``from_pretrained`` on one
    process; call it on every rank (each tensor is gathered in turn). Returns ``export_consolidated``'s counts."""
    import torch.distributed as dist

    main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    return sharded.export_consolidated(model, directory, max_shard_size=max_shard_size, is_main_process=main)
