"""Checkpoints written by accelerate's ``Accelerator.save_state``, loaded into trainer_ext's prepared objects.

A job started under accelerate continues after its import is switched. The folder is recognised by accelerate
1.15's file names: ``model[_i].safetensors`` or ``pytorch_model[_i].bin`` (``safe_serialization`` True or False),
``optimizer[_i].bin``, ``scheduler[_i].bin``, ``scaler.pt``, ``random_states_<rank>.pkl`` and
``custom_checkpoint_<i>.pkl``, and no ``state.json`` (which every save of ours writes). What accelerate's
``load_state`` restores is restored as it restores it: the loaders keep their position, so a script calls
``skip_first_batches`` for the resumed epoch, as accelerate's examples do.

Safe loading: every pickle is read with ``torch.load(weights_only=True)`` and only NumPy's array types added to
the allow-list (what accelerate 1.15 and transformers allow for RNG states); a file naming anything else is refused
and nothing in it runs (accelerate itself unpickles ``custom_checkpoint_<i>.pkl`` in full: we do not). Folders of
accelerate's FSDP, DeepSpeed and Megatron-LM plugins, and stateful-dataloader positions, are refused.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from trainer_ext.checkpointing import sharded as sharded_checkpoint
from trainer_ext.checkpointing.marker import COMPLETE, is_complete, read_marker
from trainer_ext.checkpointing.model_keys import check_loaded_keys, optimizer_owner
from trainer_ext.checkpointing.safe_globals import numpy_rng_safe_globals
from trainer_ext.checkpointing.together import agreed
from trainer_ext.errors import ConfigError

__all__ = ["is_accelerate_checkpoint", "load_accelerate_state", "loaded_lines", "saved_lines"]
logger = logging.getLogger(__name__)

OURS = "state.json"  # written by every save_state of ours, never by accelerate's
NOTICE = "loading accelerate checkpoint %s (written by accelerate's save_state)"
_FILES = re.compile(
    r"(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|(optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin"
    r"|scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl)"
)
_CUSTOM = re.compile(r"custom_checkpoint_(\d+)\.pkl")
_RANK_STATES = re.compile(r"random_states_(\d+)\.pkl")
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
# the model wrappers whose names prefix the keys accelerate saves (it saves the prepared model: DDP, compiled)
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def numbered(stem: str, index: int, suffix: str) -> str:
    """accelerate's file names: ``optimizer.bin`` for the first object, ``optimizer_1.bin`` after it."""
    return f"{stem}{suffix}" if index == 0 else f"{stem}_{index}{suffix}"


def _model_files(index: int) -> tuple[str, str]:
    """Model ``index``'s file with safe_serialization (safetensors) and without (torch.save)."""
    return numbered("model", index, ".safetensors"), numbered("pytorch_model", index, ".bin")


def _plugin_layout(src: Path, names: set[str]) -> str | None:
    """What accelerate plugin wrote ``src``, when its models are not in whole files, else None."""
    fsdp = sorted(name for name in names if name.startswith("pytorch_model_fsdp"))
    if fsdp:
        return f"its FSDP plugin ({fsdp[0]})"
    deepspeed = sorted(n for n in names if re.fullmatch(r"pytorch_model(_\d+)?", n) and (src / n).is_dir())
    if deepspeed:
        return f"its DeepSpeed plugin ({deepspeed[0]}/)"
    if "latest_checkpointed_iteration.txt" in names:
        return "its Megatron-LM plugin (latest_checkpointed_iteration.txt)"
    return None


def is_accelerate_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` was written by accelerate's ``save_state`` (whole or in part), not by ours."""
    src = Path(directory)
    if not src.is_dir() or (src / OURS).exists():
        return False
    names = {entry.name for entry in src.iterdir()}
    if COMPLETE in names and is_complete(src) and OURS in ((read_marker(src) or {}).get("files") or ()):
        return False  # ours, with its state.json lost: the loader of ours says what is wrong
    return any(_FILES.fullmatch(name) for name in names) or _plugin_layout(src, names) is not None


def _refuse_unsupported(src: Path, strategy: Any) -> None:
    """ConfigError for what this loader cannot restore as accelerate would: plugin layouts, loader states."""
    names = {entry.name for entry in src.iterdir()}
    layout = _plugin_layout(src, names)
    if layout is not None:
        raise ConfigError(
            f"{str(src)!r} is an accelerate checkpoint written by {layout}: trainer_ext reads accelerate's "
            "whole-model checkpoints only (saved without FSDP, DeepSpeed or Megatron-LM); resume it under "
            "accelerate, or start a new run from its consolidated weights"
        )
    if strategy is not None and not strategy.loads_whole_model_state():
        raise ConfigError(
            f"{str(src)!r} is an accelerate checkpoint of whole models, and this run uses {strategy.title}, which "
            f"trainer_ext resumes only from its own checkpoints; continue it without {strategy.title}, or under "
            "accelerate"
        )
    stateful = sorted(n for n in names if re.fullmatch(r"dl_state_dict(_\d+)?\.bin", n))
    if stateful:
        raise ConfigError(
            f"{str(src)!r} holds {stateful[0]}, a dataloader position saved by accelerate's use_stateful_dataloader "
            "(torchdata's StatefulDataLoader), which trainer_ext cannot translate; remove it and call "
            "accelerator.skip_first_batches(dataloader, n) for the resumed epoch, or resume under accelerate"
        )
    samplers = sorted(n for n in names if re.fullmatch(r"sampler(_\d+)?\.bin", n))
    if samplers:
        raise ConfigError(
            f"{str(src)!r} holds {samplers[0]}, a pickled sampler object that only a full unpickle could rebuild "
            "(it could run code): refused; remove it to load the rest (the loader then starts as freshly prepared)"
        )


def _require(src: Path, models: int, optimizers: int, schedulers: int, custom: int) -> None:
    """ConfigError naming every file the prepared objects need that the folder lacks (half-written, or not theirs)."""
    missing = []
    for i in range(models):
        safe, pickled = _model_files(i)
        if not (src / safe).is_file() and not (src / pickled).is_file():
            missing.append(f"{safe} (or {pickled})")
    names = [numbered("optimizer", i, ".bin") for i in range(optimizers)]
    names += [numbered("scheduler", i, ".bin") for i in range(schedulers)] + ["random_states_0.pkl"]
    missing += [name for name in names if not (src / name).is_file()]
    if missing:
        raise ConfigError(
            f"{str(src)!r} is an accelerate checkpoint without {', '.join(missing)}: interrupted while saving, or "
            "saved for other prepared objects; pick another checkpoint directory, or prepare the same models, "
            "optimizers and schedulers as the run that saved it"
        )
    found = sorted(int(m.group(1)) for e in src.iterdir() if (m := _CUSTOM.fullmatch(e.name)))
    if found != list(range(custom)):
        raise ConfigError(
            f"{str(src)!r} holds {len(found)} custom checkpoint(s) (custom_checkpoint_<i>.pkl) but {custom} "
            "object(s) are registered with register_for_checkpointing: register the same objects, in the same "
            "order, as the run that saved it"
        )


def _safe_load(path: Path, map_location: Any = "cpu", hint: str = "") -> Any:
    """``torch.load(weights_only=True)`` with NumPy's array types allowed; one-line ConfigError otherwise."""
    try:
        with numpy_rng_safe_globals():
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        named = _UNSUPPORTED_GLOBAL.search(str(error))
        raise ConfigError(
            f"{str(path)!r} holds objects that only a full unpickle could rebuild"
            f"{f' ({named.group(1)})' if named else ''}, which could run code: refused, nothing in it was run{hint}"
        ) from error
    except (RuntimeError, EOFError, OSError) as error:
        reason = " ".join(str(error).split())[:200]
        raise ConfigError(f"{str(path)!r} cannot be read ({reason}); pick another checkpoint directory") from error


def _read_model(src: Path, index: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Model ``index``'s saved tensors, named as ``model`` names them (the wrappers' prefixes removed)."""
    safe, pickled = _model_files(index)
    if (src / safe).is_file():
        try:
            saved = load_file(str(src / safe))
        except (SafetensorError, OSError) as error:
            reason = " ".join(str(error).split())[:200]
            raise ConfigError(f"{str(src / safe)!r} cannot be read ({reason}); pick another checkpoint") from error
    else:
        saved = _safe_load(src / pickled)
    expected = set(model.state_dict())
    for _ in range(2 * len(_WRAPPER_PREFIXES)):  # DDP and torch.compile wrap in either order
        if set(saved) <= expected:
            break
        prefix = next((p for p in _WRAPPER_PREFIXES if saved and all(k.startswith(p) for k in saved)), None)
        if prefix is None:
            break
        saved = {name[len(prefix) :]: tensor for name, tensor in saved.items()}
    check_loaded_keys(index, model, sorted(expected - set(saved)), sorted(set(saved) - expected))
    return saved


def _read_random_states(path: Path) -> dict[str, Any]:
    """A process's ``random_states_<rank>.pkl``, each generator state checked on a scratch generator first."""
    states = _safe_load(path)
    try:
        random.Random().setstate(states["random_state"])
        np.random.RandomState().set_state(states["numpy_random_seed"])
        torch.Generator().set_state(states["torch_manual_seed"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise ConfigError(
            f"{str(path)!r} is not accelerate's random states ({type(error).__name__}: {error}); pick another "
            "checkpoint directory"
        ) from error
    return states


def _read(src: Path, state: Any, objects: dict[str, Any]) -> dict[str, Any]:
    """Everything this process loads, read and checked before anything is changed."""
    location = state.device
    custom_hint = (
        "; accelerate unpickles registered objects' states in full, trainer_ext does not: make state_dict() "
        "return tensors, numbers, strings, lists and dicts, or load the file yourself if you trust it"
    )
    own = src / f"random_states_{state.process_index}.pkl"
    scaler = objects["scaler"]
    return {
        "models": [_read_model(src, i, model) for i, model in enumerate(objects["models"])],
        "optimizers": [
            _safe_load(src / numbered("optimizer", i, ".bin"), location) for i in range(len(objects["optimizers"]))
        ],
        "schedulers": [_safe_load(src / numbered("scheduler", i, ".bin")) for i in range(len(objects["schedulers"]))],
        "scaler": _safe_load(src / "scaler.pt") if scaler is not None and (src / "scaler.pt").is_file() else None,
        "random": _read_random_states(own) if own.is_file() else None,
        "custom": [
            _safe_load(src / f"custom_checkpoint_{i}.pkl", hint=custom_hint) for i in range(len(objects["custom"]))
        ],
    }


def _apply(read: dict[str, Any], objects: dict[str, Any], device: torch.device) -> None:
    """Load what :func:`_read` returned into the prepared objects, in accelerate's order."""
    strategy, models = objects["strategy"], objects["models"]
    for model, saved in zip(models, read["models"], strict=True):
        if strategy is not None and strategy.shards_model(model):  # each rank keeps its shards of the whole tensors
            set_model_state_dict(model, saved, options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            model.load_state_dict(saved, strict=False)  # names checked by _read_model (tied ones are saved once)
    sharding = strategy is not None and any(strategy.shards_model(model) for model in models)
    for optimizer, saved in zip(objects["optimizers"], read["optimizers"], strict=True):
        owner = optimizer_owner(optimizer, models) if sharding else None
        if owner is not None and strategy.shards_model(owner):  # the whole state, cut to this rank's shards
            sharded_checkpoint.load_full_optimizer(owner, optimizer, saved)
        else:
            optimizer.load_state_dict(saved)
    for scheduler, saved in zip(objects["schedulers"], read["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    if read["scaler"] is not None:
        objects["scaler"].load_state_dict(read["scaler"])
    states = read["random"]
    if states is not None:
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
        if device.type == "cuda" and "torch_cuda_manual_seed" in states:
            torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    for obj, saved in zip(objects["custom"], read["custom"], strict=True):
        obj.load_state_dict(saved)


def _agreed(state: Any, src: Path, work: Callable[[], Any]) -> Any:
    """``work()`` on every process; when it failed anywhere every process raises (none goes on alone)."""
    return agreed(
        work,
        lambda error: f"process {state.process_index}: {error}",
        lambda lines: ConfigError(f"load_state: {str(src)!r} could not be loaded on {lines}"),
    )


def load_accelerate_state(directory: str | os.PathLike, state: Any, **objects: Any) -> dict[str, Any]:
    """Every process: restore accelerate's checkpoint ``directory`` into ``objects`` (``models``, ``optimizers``,
    ``schedulers``, ``dataloaders``, ``scaler``, ``custom``, ``strategy``, as :mod:`.loop_state` takes them).

    Returns ``step`` (this process's saved step counter, None without its random states), ``scaler`` and
    ``random`` (whether a scaler state and random states were loaded). The loaders are left where they are, as
    accelerate leaves them.
    """
    src = Path(directory)
    objects.setdefault("custom", [])
    objects.setdefault("scaler", None)
    objects.setdefault("strategy", None)
    if state.is_main_process:
        logger.warning(
            NOTICE + ": models, optimizers, schedulers, registered objects and random states are restored; the "
            "dataloaders start their epoch from the beginning, as under accelerate (skip_first_batches skips "
            "what was seen)",
            src,
        )

    def read() -> dict[str, Any]:
        _refuse_unsupported(src, objects["strategy"])
        counts = (len(objects[kind]) for kind in ("models", "optimizers", "schedulers", "custom"))
        _require(src, *counts)
        return _read(src, state, objects)

    loaded = _agreed(state, src, read)
    saved_ranks = sorted(int(m.group(1)) for e in src.iterdir() if (m := _RANK_STATES.fullmatch(e.name)))
    if loaded["random"] is None:  # accelerate's behaviour: a process the checkpoint did not have keeps its own
        logger.warning(
            "load_state: %s holds no random states for process %d (saved by %d processes); it keeps its own",
            src,
            state.process_index,
            len(saved_ranks),
        )
    _agreed(state, src, lambda: _apply(loaded, objects, state.device))
    states = loaded["random"]
    return {
        "step": int(states["step"]) if states is not None and "step" in states else None,
        "scaler": loaded["scaler"] is not None,
        "random": states is not None,
    }


def _pretty_name(obj: Any) -> str:
    """How accelerate names a registered object in its log lines: its class's qualified name."""
    target = obj if hasattr(obj, "__qualname__") or hasattr(obj, "__name__") else type(obj)
    return str(getattr(target, "__qualname__", None) or getattr(target, "__name__", type(obj).__name__))


def saved_lines(folder: str | os.PathLike, dataloaders: int, custom: list[Any], scaler: bool) -> list[str]:
    """accelerate's ``save_state`` log lines (after "Saving current state to …"), for what ``folder`` now holds."""
    out = Path(folder)
    names = {entry.name for entry in out.iterdir()}
    lines = []
    i = 0
    while numbered("model", i, ".safetensors") in names or f"model_{i}" in names:
        if f"model_{i}" in names:  # sharded (FSDP), every process its shards
            lines.append(f"FSDP Model saved to output dir {out}")
        else:
            lines.append(f"Model weights saved in {out / numbered('model', i, '.safetensors')}")
        i += 1
    if "deepspeed" in names:
        lines.append(f"DeepSpeed Model and Optimizer saved to output dir {out / 'deepspeed'}")
    i = 0
    while numbered("optimizer", i, ".bin") in names or f"optimizer_{i}" in names:
        if f"optimizer_{i}" in names and (out / f"optimizer_{i}").is_dir():
            lines.append(f"FSDP Optimizer saved to output dir {out}")
        else:
            lines.append(f"Optimizer state saved in {out / numbered('optimizer', i, '.bin')}")
        i += 1
    i = 0
    while numbered("scheduler", i, ".bin") in names:
        lines.append(f"Scheduler state saved in {out / numbered('scheduler', i, '.bin')}")
        i += 1
    # ours keeps each loader's position with the process's random states
    lines += [f"Sampler state for dataloader {i} saved in {out / 'random_states_0.pkl'}" for i in range(dataloaders)]
    if scaler and "scaler.pt" in names:
        lines.append(f"Gradient scaler state saved in {out / 'scaler.pt'}")
    lines.append(f"Random states saved in {out / 'random_states_0.pkl'}")
    lines += [
        f"Saving the state of {_pretty_name(obj)} to {out / f'custom_checkpoint_{i}.pkl'}"
        for i, obj in enumerate(custom)
    ]
    return lines


def loaded_lines(folder: str | os.PathLike, custom: list[Any], scaler: bool, random_states: bool) -> list[str]:
    """accelerate's ``load_state`` log lines (after "Loading states from …") for a load that succeeded."""
    lines = [
        "All model weights loaded successfully",
        "All optimizer states loaded successfully",
        "All scheduler states loaded successfully",
        "All dataloader sampler states loaded successfully",
    ]
    lines += ["GradScaler state loaded successfully"] if scaler else []
    lines.append("All random states loaded successfully" if random_states else "Could not load random states")
    lines.append(f"Loading in {len(custom)} custom states")
    lines += [
        f"Loading the state of {_pretty_name(obj)} from {os.path.join(folder, f'custom_checkpoint_{i}.pkl')}"
        for i, obj in enumerate(custom)
    ]
    return lines
