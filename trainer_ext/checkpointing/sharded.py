"""Sharded checkpoints (``torch.distributed.checkpoint``) and the consolidated export of a sharded model.

Each rank writes its own shards; loading reshards to whatever the current job holds (FSDP on N ranks, or a
plain model on one process), so a run can resume on another number of processes. The checkpoint of a model with
adapters (PEFT) holds what it trains (the adapter, no frozen base), as transformers' own PEFT checkpoints do. The
export writes ``from_pretrained``-loadable safetensors from the main process one file at a time: no rank ever holds
the whole model, only one output file and the tensor being gathered.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from trainer_ext.checkpointing.safe_dcp import (
    METADATA,
    SafeLoadPlanner,
    SafeReader,
    UnsafeCheckpointError,
    load_metadata,
)
from trainer_ext.checkpointing.saving import drop_tied, has_adapters, plan_shards, write_shards
from trainer_ext.errors import ConfigError

MODEL_DIR = "model_sharded"
OPTIMIZER_DIR = "optimizer_sharded"


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # the engine's wrapper holds the torch optimizer


def _no_dist() -> bool:
    """One process without a process group (a sharded run resumed on one process)."""
    return not (dist.is_available() and dist.is_initialized())


def _dcp(func: Any, state: dict[str, Any], path: Path) -> None:
    """``dcp.save``/``dcp.load`` on the process group, or on this process alone (without DCP's warning).

    Loading reads the metadata through an allow-list and non-tensor values ``weights_only`` (``safe_dcp``).
    """
    safe = {"storage_reader": SafeReader(path), "planner": SafeLoadPlanner()} if func is dcp.load else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            func(state, checkpoint_id=str(path), no_dist=_no_dist(), **safe)
        except CheckpointException as error:  # DCP wraps what a rank raised: a refusal is ours to report
            refused = [exc for exc, _ in error.failures.values() if isinstance(exc, UnsafeCheckpointError)]
            if refused:
                raise refused[0] from error
            raise


def has_sharded_model(directory: str | os.PathLike) -> bool:
    return (Path(directory) / MODEL_DIR / METADATA).is_file()


def has_sharded_optimizer(directory: str | os.PathLike) -> bool:
    return (Path(directory) / OPTIMIZER_DIR / METADATA).is_file()


def saved_shapes(directory: str | os.PathLike) -> dict[str, list[int]]:
    """Names and full shapes of the tensors in a sharded model checkpoint (reads the metadata only, safely)."""
    metadata = load_metadata(Path(directory) / MODEL_DIR / METADATA)
    return {k: list(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}


def shape_problems(
    saved: dict[str, Any], expected: dict[str, Any], must_have: Iterable[str] | None = None
) -> list[str]:
    """What differs between ``saved`` and ``expected`` (names to shapes), one line per kind; empty when they match.

    ``must_have``: the names the saved side must hold (default: all of ``expected``); the one comparison every
    "does this checkpoint hold this model?" check uses.
    """
    required = set(expected if must_have is None else must_have)
    missing = sorted(required - saved.keys())
    unknown = sorted(saved.keys() - expected.keys())
    wrong = [
        f"{k} {list(saved[k])} vs {list(expected[k])}"
        for k in sorted(expected.keys() & saved.keys())
        if list(saved[k]) != list(expected[k])
    ]
    return [
        f"{kind}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
        for kind, items in (("shapes differ", wrong), ("missing tensors", missing), ("unknown tensors", unknown))
        if items
    ]


def check_shapes(
    label: str, saved: dict[str, list[int]], expected: dict[str, list[int]], must_have: Iterable[str] | None = None
) -> None:
    """ConfigError naming what differs when ``saved`` (names to full shapes) is not ``expected``'s model."""
    problems = shape_problems(saved, expected, must_have)
    if problems:
        raise ConfigError(f"{label} holds another model: " + "; ".join(problems))


def _model_options(model: torch.nn.Module) -> StateDictOptions:
    """A model with adapters (PEFT) checkpoints its trainable tensors only: its frozen base is the one the resuming
    run builds."""
    peft = has_adapters(model)
    return StateDictOptions(ignore_frozen_params=peft, strict=not peft)


def check_model_matches(model: torch.nn.Module, directory: str | os.PathLike) -> None:
    """ConfigError when the sharded checkpoint holds another model (names or full shapes differ); the checkpoint of
    a model with adapters may leave out its frozen parameters."""
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    must_have = None
    whole = getattr(model, "_trainer_ext_full_shapes", None)
    if whole is not None:  # one pipeline stage's part of the model: the checkpoint holds the whole of it
        must_have, expected = list(expected), whole
    elif has_adapters(model):
        frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        must_have = [name for name in expected if name not in frozen]
    check_shapes(Path(directory).name, saved_shapes(directory), expected, must_have)


def save_model(model: torch.nn.Module, directory: str | os.PathLike) -> None:
    """Every rank writes its shards of the model to ``directory/model_sharded`` (a collective)."""
    _dcp(dcp.save, get_model_state_dict(model, options=_model_options(model)), Path(directory) / MODEL_DIR)


def _flat(flatten: bool) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=flatten)


def _is_flat(directory: Path) -> bool:
    """Whether an optimizer checkpoint keeps its hyperparameters per parameter (``param_groups.<name>.lr``), not per
    group (``param_groups.0.lr``: the group list as DCP flattens it)."""
    metadata = load_metadata(directory / METADATA)
    return any(
        key.startswith("param_groups.") and not key.split(".")[1].isdigit() for key in metadata.state_dict_metadata
    )


def save_optimizer(model: torch.nn.Module, optimizer: Any, directory: str | os.PathLike) -> None:
    """Every rank writes its shards of the optimizer state, keyed by parameter name (a collective). A pipeline stage
    keeps its hyperparameters per parameter too: each rank's groups hold other parameters, and one list of groups
    saved for all would lose the others'."""
    flatten = getattr(model, "_trainer_ext_full_shapes", None) is not None
    state = get_optimizer_state_dict(model, _inner(optimizer), options=_flat(flatten))
    _dcp(dcp.save, state, Path(directory) / OPTIMIZER_DIR)


def load_model(model: torch.nn.Module, directory: str | os.PathLike) -> None:
    """Load a sharded model checkpoint into ``model``, sharded or not, on any number of processes."""
    check_model_matches(model, directory)
    options = _model_options(model)
    state = get_model_state_dict(model, options=options)
    _dcp(dcp.load, state, Path(directory) / MODEL_DIR)
    set_model_state_dict(model, state, options=options)


def load_optimizer(model: torch.nn.Module, optimizer: Any, directory: str | os.PathLike) -> None:
    """Load a sharded optimizer checkpoint into ``optimizer`` (resharded to this job's layout)."""
    options = _flat(_is_flat(Path(directory) / OPTIMIZER_DIR))
    state = get_optimizer_state_dict(model, _inner(optimizer), options=options)
    _dcp(dcp.load, state, Path(directory) / OPTIMIZER_DIR)
    set_optimizer_state_dict(model, _inner(optimizer), state, options=options)


def load_full_optimizer(model: torch.nn.Module, optimizer: Any, saved: dict[str, Any]) -> None:
    """Load an unsharded ``optimizer.state_dict()`` (parameters by index) into a sharded model's optimizer. An
    optimizer that lost other pipeline stages' parameters indexes by the whole model's order it was built with."""
    inner = _inner(optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    order = getattr(inner, "_trainer_ext_full_param_order", None) or [
        names[id(p)] for group in inner.param_groups for p in group["params"]
    ]
    here = set(names.values())
    state = {order[i]: value for i, value in saved["state"].items() if order[i] in here}
    groups = [{**g, "params": [order[i] for i in g["params"] if order[i] in here]} for g in saved["param_groups"]]
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, inner, {"state": state, "param_groups": groups}, options=options)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered from every rank for a DTensor: a collective), detached, on the CPU."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu").contiguous()


def export_consolidated(
    model: torch.nn.Module,
    directory: str | os.PathLike,
    *,
    max_shard_size: str | int = "5GB",
    is_main_process: bool = True,
) -> dict[str, int]:
    """Write the full model as safetensors (+ index when several files) from the main process; call on all ranks.

    The files are planned from shapes and dtypes (``saving.plan_shards``), then each is gathered one tensor at a
    time and written, so the main process holds at most one output file plus one tensor. Returns
    ``{"files", "tensors", "peak_bytes"}`` (``peak_bytes``: most bytes held at once).
    """
    entries = drop_tied(model.state_dict(keep_vars=True))  # keep_vars: a tied DTensor is one object
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        entries.pop(key, None)
    plan = plan_shards(entries, max_shard_size)  # the same on every rank: they gather in the same order
    peak = 0

    def gather(names: list[str]) -> dict[str, torch.Tensor]:
        nonlocal peak
        held: dict[str, torch.Tensor] = {}
        for name in names:
            full = _full(entries[name])  # every rank takes part in the gather
            if is_main_process:
                held[name] = full
                peak = max(peak, sum(t.numel() * t.element_size() for t in held.values()))
            del full
        return held

    out = write_shards(directory, plan, gather, write=is_main_process)
    if is_main_process:
        if hasattr(model, "config") and hasattr(model.config, "save_pretrained"):
            model.config.save_pretrained(out)
        generation = getattr(model, "generation_config", None)
        if generation is not None and hasattr(model, "can_generate") and model.can_generate():
            generation.save_pretrained(out)
    return {"files": len(plan.filename_to_tensors), "tensors": len(entries), "peak_bytes": peak}


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict on the CPU of the main process (empty elsewhere); a collective for sharded models."""
    main = not dist.is_initialized() or dist.get_rank() == 0
    state = {}
    for name, tensor in model.state_dict().items():
        full = _full(tensor)
        if main:
            state[name] = full
    return state
