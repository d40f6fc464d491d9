"""Reading ``torch.distributed.checkpoint`` folders without running code that a checkpoint file could smuggle in.

DCP reads ``.metadata`` with a plain ``pickle.load`` and non-tensor values (``BYTE_IO`` items: optimizer
hyper-parameters) with ``torch.load(weights_only=False)``: a crafted checkpoint could run anything on resume.
Here the metadata is unpickled with an allow-list of the classes DCP metadata legitimately holds, and the
non-tensor values with ``weights_only=True``; tensors DCP already reads with ``weights_only=True``.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from trainer_ext.errors import ConfigError

METADATA = ".metadata"
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
_DCP_CLASSES = (
    "Metadata",
    "StorageMeta",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "_MEM_FORMAT_ENCODING",
)
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(dcp_metadata.__name__, n): getattr(dcp_metadata, n) for n in _DCP_CLASSES if hasattr(dcp_metadata, n)},
    (dcp_filesystem.__name__, "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("pathlib", n): getattr(pathlib, n) for n in _PATHS},
    # a layout is pickled as this lookup called on its name (it returns an existing torch.layout, nothing else)
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
}


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file that only a full unpickle could read (it could run code): refused."""


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP metadata from the allow-list only: DCP's dataclasses, sizes, dtypes, paths."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not something checkpoint metadata holds")
        return found


def load_metadata(path: str | os.PathLike) -> Metadata:
    """Unpickle a DCP ``.metadata`` file with the allow-list; UnsafeCheckpointError names what was refused."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, KeyError, TypeError, ValueError) as error:
        raise UnsafeCheckpointError(
            f"{path.parent.name}/{path.name} cannot be read safely ({_reason(error)}); "
            "refused: it is corrupted or was crafted to run code"
        ) from error
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{path.parent.name}/{path.name} holds a {type(metadata).__name__}, not DCP metadata"
        )
    _check_paths(path, metadata)
    return metadata


def _check_paths(path: Path, metadata: Metadata) -> None:
    """Every file the metadata names (tensors and values alike) is a file name of its own folder."""
    storage = metadata.storage_data or {}
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(
            f"{path.parent.name}/{path.name} is malformed (its storage table is not a mapping)"
        )
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise UnsafeCheckpointError(
                f"{path.parent.name}/{path.name} points outside its folder ({name!r}): refused, it is corrupted or "
                "crafted; pick another checkpoint"
            )


def _reason(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]


def check_values(folder: str | os.PathLike, metadata: Metadata | None = None) -> None:
    """Load every non-tensor value of a DCP folder ``weights_only`` (they are small): UnsafeCheckpointError if refused.

    Checks ahead what ``SafeLoadPlanner`` would refuse while loading, so a resume can pass over such a checkpoint.
    """
    root = Path(folder)
    metadata = metadata if metadata is not None else load_metadata(root / METADATA)
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):
            continue  # a compressed value: the planner checks it while loading
        with open(root / info.relative_path, "rb") as handle:
            handle.seek(info.offset)
            raw = handle.read(info.length)
        try:
            torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as error:
            raise UnsafeCheckpointError(
                f"{root.name}: the value of {index.fqn!r} cannot be loaded safely (weights_only=True): {_reason(error)}"
            ) from error


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read through the allow-list (``dcp.load(storage_reader=...)``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = load_metadata(Path(self._get_metadata_path(rank)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with non-tensor values read ``weights_only=True`` (plain numbers, strings …)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"the value of {read_item.dest_index.fqn!r} in the sharded checkpoint cannot be loaded safely "
                f"(weights_only=True): {_reason(error)}"
            ) from error
        # what DefaultLoadPlanner.load_bytes does with the value, once unpickled
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
