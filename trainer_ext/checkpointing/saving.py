"""Save a model as safetensors, sharded above a size, the way ``from_pretrained`` reads it back.

The one sharder (huggingface_hub's ``split_torch_state_dict_into_shards``, which ``save_pretrained`` uses too),
the one rule for tied weights (state-dict entries holding the same tensor, saved once under the first name), and
the one adapter export of a model no rank holds whole (FSDP2, DeepSpeed): its adapter only, gathered.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from huggingface_hub import get_torch_storage_id, split_torch_state_dict_into_shards
from safetensors.torch import save_file

from trainer_ext.values import parse_size

if TYPE_CHECKING:
    from huggingface_hub import StateDictSplit

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_PATTERN = "model{suffix}.safetensors"  # model.safetensors, or model-00001-of-00003.safetensors ...
# what an earlier save into the same folder may have left (save_torch_state_dict's rule)
_EARLIER_SAVE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


# -- tied weights ----------------------------------------------------------------------------------
def _tie_key(tensor: torch.Tensor) -> Any:
    """Entries with equal keys hold one tensor. A shard (DTensor, ZeRO-3 partition) or a meta tensor: the same
    object (``state_dict(keep_vars=True)``); otherwise the same view of the same storage (huggingface_hub's storage
    id, offset, shape, strides), so distinct views of one flat buffer (DeepSpeed ZeRO-1/2) stay distinct."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # none without that module
    if (dtensor is not None and isinstance(tensor, dtensor)) or hasattr(tensor, "ds_shape"):
        return id(tensor)
    if tensor.device.type == "meta":
        return id(tensor)
    if tensor.numel() == 0:
        return None  # nothing stored: never tied
    try:
        view = (tensor.storage_offset(), tensor.stride())
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (quantized ...): its storage id says it all
        view = ()
    return get_torch_storage_id(tensor), tuple(tensor.shape), *view


def tied_groups(state_dict: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The names that hold one same tensor (tied weights): groups of two or more, each in state-dict order."""
    groups: dict[Any, list[str]] = {}
    for name, tensor in state_dict.items():
        key = _tie_key(tensor)
        if key is not None:
            groups.setdefault(key, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def drop_tied(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with each tied group under its first name only (safetensors refuses shared storage;
    ``save_pretrained`` keeps the same name, the tie's source, e.g. ``model.embed_tokens.weight``)."""
    later = {name for names in tied_groups(state_dict) for name in names[1:]}
    return {name: tensor for name, tensor in state_dict.items() if name not in later}


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().cpu()


def unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each storage once (safetensors refuses tied weights), contiguous, on the CPU."""
    return {name: _on_cpu(tensor) for name, tensor in drop_tied(model.state_dict()).items()}


# -- the sharder -----------------------------------------------------------------------------------
def plan_shards(tensors: Mapping[str, torch.Tensor], max_shard_size: str | int) -> StateDictSplit:
    """Which file each tensor goes to, file names as ``save_pretrained`` writes them; a tensor bigger than
    ``max_shard_size`` gets a file of its own. Reads shapes and dtypes only (a sharded tensor is not gathered)."""
    meta = {name: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for name, t in tensors.items()}
    return split_torch_state_dict_into_shards(
        meta, filename_pattern=_PATTERN, max_shard_size=parse_size(max_shard_size)
    )


def write_shards(
    directory: str | os.PathLike,
    plan: StateDictSplit,
    tensors_of: Callable[[list[str]], Mapping[str, torch.Tensor]],
    *,
    write: bool = True,
) -> Path:
    """Write each file of ``plan`` with the CPU tensors ``tensors_of(names)`` returns, then the index if several.

    ``tensors_of`` is called once per file, in the plan's order, whether or not this process ``write``s (it may
    gather a sharded tensor: a collective), so only one file's tensors are held at a time. The writing process
    first removes what an earlier save left in the folder (``model*.safetensors`` and index), as
    ``save_pretrained`` does, so no stale shard or index is read back.
    """
    out = Path(directory)
    if write:
        out.mkdir(parents=True, exist_ok=True)
        for path in out.iterdir():
            if path.is_file() and _EARLIER_SAVE.fullmatch(path.name):
                path.unlink()
    for filename, names in plan.filename_to_tensors.items():
        tensors = tensors_of(names)
        if write:
            save_file(dict(tensors), str(out / filename), metadata={"format": "pt"})
        del tensors
    if write and plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out


def save_model(
    model: torch.nn.Module,
    directory: str | os.PathLike,
    max_shard_size: str | int = "10GB",
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """transformers models: ``save_pretrained`` (config included); other modules: sharded safetensors + index.

    ``state_dict``: the weights to write instead of the model's own (a DeepSpeed ZeRO-3 model's gathered ones).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(out, max_shard_size=parse_size(max_shard_size), state_dict=state_dict)
        return out
    tensors = drop_tied(model.state_dict() if state_dict is None else state_dict)
    plan = plan_shards(tensors, max_shard_size)
    return write_shards(out, plan, lambda names: {name: _on_cpu(tensors[name]) for name in names})


# -- PEFT adapters ---------------------------------------------------------------------------------
def is_peft_model(model: torch.nn.Module) -> bool:
    """A ``peft.PeftModel`` (duck-typed: peft is an optional dependency)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def has_adapters(model: torch.nn.Module) -> bool:
    """Saved as adapters: a PEFT model, or a transformers model given one by ``add_adapter``/``load_adapter``."""
    return is_peft_model(model) or bool(getattr(model, "_hf_peft_config_loaded", False))


def adapter_entries(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state-dict entries (``keep_vars``: shards as they are) that the model's adapters save, by its own names.

    peft picks them (``get_peft_model_state_dict``; every adapter of a PEFT model, the active one of a transformers
    model, as their ``save_pretrained`` do), so a sharded model gathers these only, never the frozen base.
    """
    from peft import get_peft_model_state_dict  # the model has adapters: peft is installed

    entries = model.state_dict(keep_vars=True)
    names = list(model.peft_config) if is_peft_model(model) else model.active_adapters()[:1]
    picked = {
        id(tensor)
        for name in names
        for tensor in get_peft_model_state_dict(model, state_dict=entries, adapter_name=name).values()
    }
    return {name: tensor for name, tensor in entries.items() if id(tensor) in picked}


def save_adapter(
    model: torch.nn.Module,
    directory: str | os.PathLike,
    gather: Callable[[torch.Tensor], torch.Tensor],
    *,
    is_main_process: bool,
) -> Path:
    """All ranks: gather the adapter tensors one by one (``gather`` may be a collective), then the main process
    writes them with the model's ``save_pretrained`` (``adapter_model.safetensors`` + ``adapter_config.json``)."""
    gathered = {}
    for name, tensor in adapter_entries(model).items():  # the same order on every rank
        full = gather(tensor)
        if is_main_process:
            gathered[name] = full
    out = Path(directory)
    if is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, state_dict=gathered)
    return out


def saved_weight_names(model: Any, state: dict[str, Any]) -> dict[str, Any] | None:
    """The state dict as ``save_pretrained`` will write it (transformers 5 renames/fuses some weights back
    to the hub layout, e.g. Mixtral experts); None when that conversion is unavailable or fails."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    try:
        return revert_weight_conversion(model, state)
    except Exception:  # a conversion that cannot run on meta tensors: the caller compares names as they are
        return None
