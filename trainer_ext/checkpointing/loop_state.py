"""Whole-state checkpoints for hand-written loops: models, optimizers, schedulers, scaler, RNG, loaders.

Every rank calls ``save_state``/``load_state``. A save is committed by :func:`.commit.commit`, staged: it goes
into a fresh sibling folder (the main process writes the shared files, each rank its own RNG and dataloader
position) that takes the place of the previous checkpoint once its marker is written, so a save that fails leaves
the previous checkpoint as it was. ``load_state`` verifies a checkpoint as the Trainer's resume does (every rank,
all agreeing) before loading; :func:`.selection.newest_state` picks the one ``load_state()`` resumes.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from trainer_ext.checkpointing import sharded as sharded_checkpoint
from trainer_ext.checkpointing.commit import commit, set_aside, staging
from trainer_ext.checkpointing.links import refuse_link, refuse_links_under
from trainer_ext.checkpointing.marker import COMPLETE, LOOP, CheckpointError, is_complete, read_marker
from trainer_ext.checkpointing.model_keys import check_loaded_keys, optimizer_owner
from trainer_ext.checkpointing.saving import unique_state_dict
from trainer_ext.checkpointing.selection import newest_own_state
from trainer_ext.checkpointing.together import verify_together
from trainer_ext.checkpointing.verification import seal_hint
from trainer_ext.errors import ConfigError

__all__ = ["COMPLETE", "latest_state", "load_state", "save_state"]
logger = logging.getLogger(__name__)


def _check_replaceable(final: Path) -> None:
    """ConfigError unless ``final`` is absent, empty or a complete checkpoint holding only what it lists.

    A save replaces the whole folder: anything else in it would be lost.
    """
    if not final.exists():
        return
    if not final.is_dir():
        raise ConfigError(f"{str(final)!r} is a file; save_state needs a folder: pick another output_dir")
    present = {str(p.relative_to(final)) for p in final.rglob("*") if p.is_file() and p.name != COMPLETE}
    body = read_marker(final) if is_complete(final) else None  # a damaged marker commits nothing
    listed = set((body or {}).get("files") or ())
    others = sorted(present - listed)
    if others:
        raise ConfigError(
            f"{str(final)!r} holds files that are not part of a complete checkpoint ({', '.join(others[:3])}"
            f"{' ...' if len(others) > 3 else ''}); save_state replaces the whole folder, so it refuses: move them "
            "or pick another output_dir"
        )


def _refuse_links(final: Path) -> None:
    """ConfigError (one line) when the folder, its staging and set-aside names, or anything inside the folder being
    replaced is a symbolic link: a save never writes, renames into or deletes through a link."""
    for folder, what in (
        (final, "the save_state folder"),
        (staging(final), "a save_state staging folder"),
        (set_aside(final), "a save_state folder set aside"),
    ):
        refuse_link(folder, what)
        if folder.is_dir():  # reused, or a crash's leftover that may be moved into its place
            refuse_links_under(folder, what)


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
    state: Any,
    *,
    models: list[torch.nn.Module],
    optimizers: list[Any],
    schedulers: list[Any],
    dataloaders: list[Any],
    scaler: Any = None,
    custom: list[Any] | None = None,
    extra: dict[str, Any] | None = None,
    strategy: Any = None,
    before_write: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint of everything passed (models already unwrapped) into ``directory``.

    ``strategy`` (the engine's) may write models and optimizers in its own way on every rank (FSDP: its shards
    with ``torch.distributed.checkpoint``, nothing gathered; DeepSpeed: the engine's checkpoint); otherwise the
    main process writes them whole. ``before_write(folder)`` runs on every rank first, with the folder being written
    (it becomes ``directory`` at the commit); it may shorten ``models`` (its files are then its own).
    """
    final = Path(directory)

    def check() -> None:  # every rank decides alike (the same files)
        _refuse_links(final)
        _check_replaceable(final)

    def write(out: Path) -> None:
        if before_write is not None:
            before_write(out)
        whole = (models, optimizers)
        if strategy is not None and strategy.save_training_state(out, models, optimizers):
            whole = ([], [])  # written by the strategy
        if state.is_main_process:
            _write_shared(out, *whole, schedulers, custom or [], scaler, extra or {})
        per_rank = {
            "rng": _rng_state(state.device),
            "dataloaders": [dl.state_dict() if hasattr(dl, "state_dict") else None for dl in dataloaders],
        }
        torch.save(per_rank, out / _rank_file(state.process_index))

    return commit(
        final,
        write,
        main=state.is_main_process,
        marker={"world_size": state.num_processes, "kind": LOOP},
        staged=True,
        check=check,
        describe=lambda error: f"rank {state.process_index}: {error!r}",
        failed=lambda stage, lines: CheckpointError(f"save_state failed while {stage} the checkpoint on {lines}"),
    )


def _numbered(stem: str, index: int, suffix: str) -> str:
    """accelerate's file names: ``model.safetensors`` for the first object, ``model_1.safetensors`` after it."""
    return f"{stem}{suffix}" if index == 0 else f"{stem}_{index}{suffix}"


def _rank_file(process_index: int) -> str:
    """A process's random states (accelerate's name) and, ours, its loaders' positions."""
    return f"random_states_{process_index}.pkl"


def _write_shared(
    out: Path,
    models: list[Any],
    optimizers: list[Any],
    schedulers: list[Any],
    custom: list[Any],
    scaler: Any,
    extra: dict[str, Any],
) -> None:
    """The files only the main process writes: whole models/optimizers (those given), schedulers, the rest."""
    for i, model in enumerate(models):
        save_file(unique_state_dict(model), str(out / _numbered("model", i, ".safetensors")))
    for i, optimizer in enumerate(optimizers):
        torch.save(optimizer.state_dict(), out / _numbered("optimizer", i, ".bin"))
    for i, scheduler in enumerate(schedulers):
        torch.save(scheduler.state_dict(), out / _numbered("scheduler", i, ".bin"))
    for i, obj in enumerate(custom):
        torch.save(obj.state_dict(), out / f"custom_checkpoint_{i}.pkl")
    if scaler is not None:
        torch.save(scaler.state_dict(), out / "scaler.pt")
    (out / "state.json").write_text(json.dumps(extra, indent=1))


def _complete(final: Path) -> Path:
    """``final``, or the complete folder a crash during the swap left beside it (saying so)."""
    if (final / COMPLETE).exists():
        return final
    for candidate in (staging(final), set_aside(final)):
        if (candidate / COMPLETE).exists():
            logger.warning(
                "load_state: %s is missing or incomplete (a save was interrupted while replacing it); loading the "
                "complete copy %s",
                final,
                candidate,
            )
            return candidate
    raise ConfigError(
        f"{str(final)!r} is not a complete checkpoint (no {COMPLETE} marker: missing or interrupted while "
        "saving); pick another checkpoint directory"
        + (seal_hint(final, "removed the marker") if final.is_dir() else "")
    )


def load_state(
    directory: str | os.PathLike,
    state: Any,
    *,
    models: list[torch.nn.Module],
    optimizers: list[Any],
    schedulers: list[Any],
    dataloaders: list[Any],
    scaler: Any = None,
    custom: list[Any] | None = None,
    strategy: Any = None,
) -> dict[str, Any]:
    """Restore what ``save_state`` wrote, in the same order of objects; returns the extra values.

    The number of processes may differ from the save's when the strategy reshards (``reshards_training_state``):
    whole files load anywhere and sharded ones are resharded by ``torch.distributed.checkpoint``; a process
    without a saved random state keeps its own, and loaders continue from process 0's position.
    """
    src = _complete(Path(directory))
    try:
        # sizes, checksums, safe headers; the ranks of a node share the reading
        verify_together(src, part=state.topology.node_share, kind=LOOP)
    except CheckpointError as error:
        raise ConfigError(f"{str(src)!r} cannot be loaded: {error}; pick another checkpoint directory") from error
    saved_ranks = int((read_marker(src) or {}).get("world_size") or 0)
    moved = saved_ranks != state.num_processes
    if moved and strategy is not None and not strategy.reshards_training_state:
        raise ConfigError(
            f"{str(src)!r} was saved by {_processes(saved_ranks)} but this run has {state.num_processes}, and "
            f"{strategy.title} checkpoints load only on the number of processes that wrote them; resume with "
            f"{_processes(saved_ranks)}"
        )
    if moved and state.is_main_process:
        logger.info(
            "load_state: %s was saved by %s, this run has %d: models and optimizers are loaded resharded, data "
            "positions from process 0's",
            src,
            _processes(saved_ranks),
            state.num_processes,
        )
    expected = [_numbered("scheduler", i, ".bin") for i in range(len(schedulers))]
    expected += [f"custom_checkpoint_{i}.pkl" for i in range(len(custom or []))]
    expected += [] if moved else [_rank_file(state.process_index)]
    _require(src, expected)
    if strategy is not None and strategy.load_training_state(src, models, optimizers):
        models, optimizers = [], []  # loaded by the strategy
    elif sharded_checkpoint.has_sharded_model(src / "model_0"):  # saved sharded, loaded into whole models
        load_sharded(src, models, optimizers)
        models, optimizers = [], []
    _require(src, [_numbered("model", i, ".safetensors") for i in range(len(models))])
    _require(src, [_numbered("optimizer", i, ".bin") for i in range(len(optimizers))])
    for i, model in enumerate(models):
        missing, unexpected = model.load_state_dict(
            load_file(str(src / _numbered("model", i, ".safetensors"))), strict=False
        )
        check_loaded_keys(i, model, missing, unexpected)
    location = state.device
    for i, optimizer in enumerate(optimizers):
        optimizer.load_state_dict(_load(src / _numbered("optimizer", i, ".bin"), map_location=location))
    for i, scheduler in enumerate(schedulers):
        scheduler.load_state_dict(_load(src / _numbered("scheduler", i, ".bin")))
    for i, obj in enumerate(custom or []):
        obj.load_state_dict(_load(src / f"custom_checkpoint_{i}.pkl"))
    if scaler is not None and (src / "scaler.pt").exists():
        scaler.load_state_dict(_load(src / "scaler.pt"))
    own = src / _rank_file(state.process_index)
    per_rank = _load(own) if own.is_file() else None
    if per_rank is not None:
        _set_rng_state(per_rank["rng"], state.device)
    else:  # accelerate's behaviour: a process the checkpoint did not have keeps its random state
        logger.warning(
            "load_state: %s holds no random state for process %d (saved by %s); it keeps its own",
            src,
            state.process_index,
            _processes(saved_ranks),
        )
    if moved:  # every process takes process 0's positions: its loader translates them to this world size
        main = per_rank if state.process_index == 0 else _load(src / _rank_file(0))
        positions = _translatable(main["dataloaders"], saved_ranks, state.num_processes, warn=state.is_main_process)
    else:
        positions = per_rank["dataloaders"]
    for dl, position in zip(dataloaders, positions, strict=False):
        if position is not None and hasattr(dl, "load_state_dict"):
            dl.load_state_dict(position)
    return json.loads((src / "state.json").read_text())


def _require(src: Path, names: list[str]) -> None:
    """Every file this run's objects need is there; else one clear error naming them (not a raw FileNotFoundError)."""
    missing = [name for name in names if not (src / name).is_file()]
    if missing:
        raise ConfigError(
            f"{str(src)!r} has no {', '.join(missing)}: it was written for other prepared objects (or by another "
            "version of save_state); prepare the same models, optimizers, schedulers and registered objects as the "
            "run that saved it, or pick another checkpoint directory"
        )


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


def _translatable(positions: list[Any], saved: int, now: int, *, warn: bool) -> list[Any]:
    """Process 0's loader positions, for a run on another number of processes.

    A position with ``global_batches`` (unsharded batches read, the same for every number of processes) is
    translated by its loader. Others (streams, dispatched loaders) count batches of this world size only: their
    loader starts the saved epoch from its beginning, which a warning says, rather than skip the wrong data.
    """
    out = []
    for i, position in enumerate(positions):
        if position is not None and "global_batches" not in position and int(position.get("batches") or 0):
            logger.log(
                logging.WARNING if warn else logging.DEBUG,  # the same on every process: said once
                "load_state: dataloader %d was %d batches per process into epoch %s on %s, a position it cannot "
                "translate to %d: it reads that epoch from its beginning (accelerator.skip_first_batches skips "
                "what was already seen)",
                i,
                int(position["batches"]),
                position.get("epoch"),
                _processes(saved),
                now,
            )
            position = {**position, "batches": 0}
        out.append(position)
    return out


def save_sharded(directory: Path, models: list[Any], optimizers: list[Any]) -> None:
    """Every rank: each model's and optimizer's shards (``model_<i>/``, ``optimizer_<i>/``), nothing gathered."""
    for i, model in enumerate(models):
        sharded_checkpoint.save_model(model, directory / f"model_{i}")
    for i, optimizer in enumerate(optimizers):
        sharded_checkpoint.save_optimizer(optimizer_owner(optimizer, models), optimizer, directory / f"optimizer_{i}")


def load_sharded(directory: Path, models: list[Any], optimizers: list[Any]) -> None:
    """Every rank: what :func:`save_sharded` wrote, resharded to these models (sharded or whole).

    A model or optimizer saved whole (by one process, or under DDP) is cut into these models' shards instead.
    """
    for i, model in enumerate(models):
        if sharded_checkpoint.has_sharded_model(directory / f"model_{i}"):
            sharded_checkpoint.load_model(model, directory / f"model_{i}")
        else:
            _load_whole_into_shards(i, model, directory / _numbered("model", i, ".safetensors"))
    for i, optimizer in enumerate(optimizers):
        owner = optimizer_owner(optimizer, models)
        if sharded_checkpoint.has_sharded_optimizer(directory / f"optimizer_{i}"):
            sharded_checkpoint.load_optimizer(owner, optimizer, directory / f"optimizer_{i}")
        else:
            saved = _load(directory / _numbered("optimizer", i, ".bin"), map_location="cpu")
            sharded_checkpoint.load_full_optimizer(owner, optimizer, saved)


def _load_whole_into_shards(i: int, model: torch.nn.Module, path: Path) -> None:
    """Every rank reads the whole file and keeps its shards of each tensor (nothing is sent between ranks)."""
    options = StateDictOptions(full_state_dict=True, strict=False)
    missing, unexpected = set_model_state_dict(model, load_file(str(path)), options=options)
    check_loaded_keys(i, model, missing, unexpected)


def latest_state(root: Path) -> Path:
    """The ``save_state`` folder of ours under ``root`` committed last (a clear error if none); what ``load_state()``
    resumes, accelerate's folders included, is :func:`.selection.newest_state`."""
    return newest_own_state(root)
