"""Disk offload: weights kept in safetensors files, memory-mapped, and read only when a module runs.

``safe_open`` memory-maps the file, so reading a tensor for the CPU costs no copy (the OS pages it in
from disk or its page cache and can drop those pages again); for a GPU it is copied straight from the
mapping. Files are written to a temporary name and renamed, so a model still reading an older file of
the same name keeps its own (renamed-over) copy instead of seeing it change under its mapping.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainer_ext.errors import ConfigError


def _said(error: Exception) -> str:
    """An error's message on one line, kept short."""
    return " ".join(str(error).split())[:300] or type(error).__name__


class SafetensorsFiles:
    """Open safetensors files, each opened (memory-mapped) once and kept open while the model lives."""

    def __init__(self) -> None:
        self._handles: dict[str, object] = {}

    def handle(self, path: str) -> object:
        """The open (memory-mapped) file."""
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="pt", device="cpu")
            except Exception as error:  # safetensors' own error type: a bad header, a truncated file
                raise ConfigError(f"{path} is not a readable safetensors file: {_said(error)}") from error
        return self._handles[path]

    def get(self, path: str, key: str) -> torch.Tensor:
        """The tensor ``key`` of ``path`` on the CPU, backed by the file's mapping."""
        handle = self.handle(path)
        try:
            return handle.get_tensor(key)
        except Exception as error:  # a name the index promised but the file lacks, data past the end
            raise ConfigError(f"{path} has no readable tensor {key!r}: {_said(error)}") from error

    def keys(self, path: str) -> list[str]:
        """The tensor names stored in ``path``."""
        return list(self.handle(path).keys())


@dataclass
class DiskTensor:
    """Where one offloaded tensor lives on disk, and the dtype to load it as (``None``: as stored)."""

    files: SafetensorsFiles
    path: str
    key: str
    dtype: torch.dtype | None = None
    _view: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def load(self, device: torch.device) -> torch.Tensor:
        """The tensor on ``device``: a view of the mapping on the CPU when no cast is needed, else a copy."""
        if self._view is None:
            # the view costs no memory of its own: its pages are the file's, read and dropped by the OS
            self._view = self.files.get(self.path, self.key)
        tensor = self._view
        dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=device, dtype=dtype)

    def owns(self, tensor: torch.Tensor) -> bool:
        """True for the mapped view itself (what ``load`` returns on the CPU without a cast)."""
        return tensor is self._view


def file_stem(entry: str) -> str:
    """A file name for the tensors of device-map entry ``entry`` (``""`` is the whole model)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", entry) or "model"


def write_offload(
    offload_dir: str, entry: str, tensors: Mapping[str, torch.Tensor], files: SafetensorsFiles
) -> dict[str, DiskTensor]:
    """Write one entry's tensors to ``offload_dir/<entry>.safetensors``; returns where each now lives."""
    os.makedirs(offload_dir, exist_ok=True)
    path = os.path.join(offload_dir, file_stem(entry) + ".safetensors")
    seen: set[int] = set()
    payload = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # safetensors refuses tensors that share memory; views get their own
        seen.add(tensor.untyped_storage().data_ptr())
        payload[name] = tensor
    tmp = path + ".tmp"
    save_file(payload, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
    return {name: DiskTensor(files, path, name) for name in payload}


def write_index(offload_dir: str, disk: Mapping[str, DiskTensor]) -> str:
    """``offload_dir/index.json``: which file holds each offloaded tensor (for people and tools)."""
    index = {name: os.path.basename(t.path) for name, t in disk.items()}
    path = os.path.join(offload_dir, "index.json")
    with open(path, "w") as f:
        json.dump({"weight_map": index}, f, indent=1, sort_keys=True)
    return path
