"""Whole-state checkpoints for hand-written loops: models, optimizers, schedulers, scaler, RNG, loaders.

Every rank calls ``save_state``/``load_state``. The main process writes the shared files, each rank
writes its own RNG and dataloader position, and a ``COMPLETE`` marker written last (after a barrier)
says the directory holds a whole checkpoint; ``load_state`` refuses a directory without it.
"""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..checkpointing.marker import COMPLETE, read_marker, remove_marker, write_marker
from ..errors import ConfigError
from ..saving import unique_state_dict
from . import sharded_checkpoint
from .state import DistState

__all__ = ["COMPLETE", "load_state", "save_state"]


def _rng_state(device: torch.device) -> dict[str, Any]:
    """Every generator's state as tensors, ints and strings: loadable with ``weights_only=True``."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(x) for x in internal.tolist()), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _load(path: Path, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True``: a file that needs arbitrary unpickling is refused."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        raise ConfigError(
            f"{str(path)!r} holds objects that only a full unpickle could rebuild (it could run code); "
            f"refused. Save plain tensors/numbers in state_dict() ({' '.join(str(error).split())[:200]})"
        ) from error


def save_state(
    directory: str | os.PathLike,
    state: DistState,
    *,
    models: list[torch.nn.Module],
    optimizers: list[Any],
    schedulers: list[Any],
    dataloaders: list[Any],
    scaler: Any = None,
    custom: list[Any] | None = None,
    extra: dict[str, Any] | None = None,
    sharded: bool = False,
    deepspeed: Any = None,
) -> Path:
    """Write a checkpoint of everything passed (models already unwrapped) into ``directory``.

    ``sharded``: models and optimizers are FSDP-sharded; every rank writes its shards (``model_<i>/``,
    ``optimizer_<i>/``, ``torch.distributed.checkpoint``) and nothing is gathered. ``deepspeed``: the DeepSpeed
    strategy, whose engine writes model and optimizer (``deepspeed/``) instead.
    """
    out = Path(directory)
    rank = state.process_index
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        remove_marker(out)
    if deepspeed is not None:
        state.wait_for_everyone()
        deepspeed.save_checkpoint(deepspeed.engine, out / "deepspeed")
        models, optimizers, sharded = [], [], False  # in DeepSpeed's checkpoint
    if sharded:
        state.wait_for_everyone()
        for i, model in enumerate(models):
            sharded_checkpoint.save_model(model, out / f"model_{i}")
        for i, optimizer in enumerate(optimizers):
            sharded_checkpoint.save_optimizer(_owner(optimizer, models), optimizer, out / f"optimizer_{i}")
    if state.is_main_process:
        if not sharded:
            for i, model in enumerate(models):
                save_file(unique_state_dict(model), str(out / f"model_{i}.safetensors"))
            for i, optimizer in enumerate(optimizers):
                torch.save(optimizer.state_dict(), out / f"optimizer_{i}.bin")
        for i, scheduler in enumerate(schedulers):
            torch.save(scheduler.state_dict(), out / f"scheduler_{i}.bin")
        for i, obj in enumerate(custom or []):
            torch.save(obj.state_dict(), out / f"custom_{i}.bin")
        if scaler is not None:
            torch.save(scaler.state_dict(), out / "scaler.pt")
        (out / "state.json").write_text(json.dumps(extra or {}, indent=1))
    state.wait_for_everyone()  # the directory exists before the ranks write into it
    per_rank = {
        "rng": _rng_state(state.device),
        "dataloaders": [dl.state_dict() if hasattr(dl, "state_dict") else None for dl in dataloaders],
    }
    torch.save(per_rank, out / f"rank_{rank}.pt")
    state.wait_for_everyone()
    if state.is_main_process:
        write_marker(out, world_size=state.num_processes)
    state.wait_for_everyone()
    return out


def load_state(
    directory: str | os.PathLike,
    state: DistState,
    *,
    models: list[torch.nn.Module],
    optimizers: list[Any],
    schedulers: list[Any],
    dataloaders: list[Any],
    scaler: Any = None,
    custom: list[Any] | None = None,
    sharded: bool = False,
    deepspeed: Any = None,
) -> dict[str, Any]:
    """Restore what ``save_state`` wrote, in the same order of objects; returns the extra values."""
    src = Path(directory)
    if not (src / COMPLETE).exists():
        raise ConfigError(
            f"{str(src)!r} is not a complete checkpoint (no {COMPLETE} marker: missing or interrupted while "
            "saving); pick another checkpoint directory"
        )
    saved_ranks = int((read_marker(src) or {}).get("world_size") or 0)
    if saved_ranks != state.num_processes:
        raise ConfigError(
            f"{str(src)!r} was saved by {saved_ranks} processes but this run has {state.num_processes}; resume "
            f"with {saved_ranks} processes"
        )
    if deepspeed is not None:
        deepspeed.load_checkpoint(deepspeed.engine, src / "deepspeed")
        models, optimizers = [], []  # loaded with the engine
    if sharded or sharded_checkpoint.has_sharded_model(src / "model_0"):
        for i, model in enumerate(models):
            sharded_checkpoint.load_model(model, src / f"model_{i}")
        for i, optimizer in enumerate(optimizers):
            sharded_checkpoint.load_optimizer(_owner(optimizer, models), optimizer, src / f"optimizer_{i}")
        models, optimizers = [], []  # loaded
    for i, model in enumerate(models):
        missing, unexpected = model.load_state_dict(load_file(str(src / f"model_{i}.safetensors")), strict=False)
        tied = {name for name in missing if _is_tied(model, name)}
        if set(missing) - tied or unexpected:
            raise ConfigError(
                f"model {i} does not match the checkpoint: missing {sorted(set(missing) - tied)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
    location = state.device
    for i, optimizer in enumerate(optimizers):
        optimizer.load_state_dict(_load(src / f"optimizer_{i}.bin", map_location=location))
    for i, scheduler in enumerate(schedulers):
        scheduler.load_state_dict(_load(src / f"scheduler_{i}.bin"))
    for i, obj in enumerate(custom or []):
        obj.load_state_dict(_load(src / f"custom_{i}.bin"))
    if scaler is not None and (src / "scaler.pt").exists():
        scaler.load_state_dict(_load(src / "scaler.pt"))
    per_rank = _load(src / f"rank_{state.process_index}.pt")
    _set_rng_state(per_rank["rng"], state.device)
    for dl, position in zip(dataloaders, per_rank["dataloaders"], strict=False):
        if position is not None and hasattr(dl, "load_state_dict"):
            dl.load_state_dict(position)
    return json.loads((src / "state.json").read_text())


def _owner(optimizer: Any, models: list[torch.nn.Module]) -> torch.nn.Module:
    """The model whose parameters ``optimizer`` updates (its shards are keyed by that model's names)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in params for p in model.parameters()):
            return model
    raise ConfigError("an optimizer updates none of the prepared models' parameters; prepare its model too")


def _is_tied(model: torch.nn.Module, name: str) -> bool:
    """True when ``name`` shares its storage with another entry of the state dict (saved once)."""
    tensors = model.state_dict()
    ptr = tensors[name].data_ptr()
    return any(other != name and t.data_ptr() == ptr for other, t in tensors.items())
