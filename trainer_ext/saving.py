"""Save a model as safetensors, sharded above a size, the way ``from_pretrained`` reads it back."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from .errors import ConfigError

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: str | int) -> int:
    """``"10GB"`` -> 10_000_000_000; ints pass through."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", str(size))
    unit = (match.group(2) or "B").upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(f"cannot read the size {size!r}; write it like '10GB', '500MB' or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


def unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each storage once (safetensors refuses tied weights), contiguous, on the CPU."""
    return _unique(model.state_dict())


def _unique(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each storage once (the first name), detached, contiguous, on the CPU."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state_dict.items():
        if tensor.data_ptr() in seen and tensor.numel() > 0:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.detach().contiguous().cpu()
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
    limit = parse_size(max_shard_size)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(out, max_shard_size=limit, state_dict=state_dict)
        return out
    tensors = unique_state_dict(model) if state_dict is None else _unique(state_dict)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out
