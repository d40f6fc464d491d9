"""Row operations on collated batches: nested dicts, lists and tuples of tensors and per-sample columns.

Dispatching joins the batches of several ranks, describes a batch so that other ranks can allocate it, and
cuts each rank's rows out of it. A *column* is a list or tuple holding no tensor (strings, numbers, lists of
token ids): one entry per row, joined and cut like a tensor. Other leaves (a 0-dim tensor, a number, None)
belong to the whole batch and are carried along unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor, sent ahead so that the receiving ranks can allocate it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _is_namedtuple(data: Any) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_fields")


def _holds_tensors(data: Any) -> bool:
    if isinstance(data, (torch.Tensor, TensorSpec, Mapping)):
        return True
    return isinstance(data, (list, tuple)) and any(_holds_tensors(v) for v in data)


def is_column(data: Any) -> bool:
    """A list or tuple without tensors: one plain value per row."""
    return isinstance(data, (list, tuple)) and not _is_namedtuple(data) and not _holds_tensors(data)


def _is_structure(data: Any) -> bool:
    return (
        isinstance(data, Mapping) or _is_namedtuple(data) or (isinstance(data, (list, tuple)) and not is_column(data))
    )


def _rebuild(like: Any, values: Any) -> Any:
    """A container of ``like``'s type holding ``values`` (a dict for mappings, an iterable otherwise)."""
    if isinstance(like, Mapping):
        try:
            return type(like)(values)
        except TypeError:
            return dict(values)
    if _is_namedtuple(like):
        return type(like)(*values)
    return type(like)(values)


def _children(data: Any) -> list[tuple[Any, Any]]:
    return list(data.items()) if isinstance(data, Mapping) else list(enumerate(data))


def _map(data: Any, leaf: Any) -> Any:
    """Apply ``leaf`` to every non-structure value, keeping the structure."""
    if not _is_structure(data):
        return leaf(data)
    pairs = [(k, _map(v, leaf)) for k, v in _children(data)]
    return _rebuild(data, dict(pairs) if isinstance(data, Mapping) else [v for _, v in pairs])


def batch_size(batch: Any) -> int | None:
    """Rows in ``batch``: the first dimension of its first tensor, else the length of its first column."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else None
    if is_column(batch):
        return len(batch)
    if _is_structure(batch):
        for _, value in _children(batch):
            size = batch_size(value)
            if size is not None:
                return size
    return None


def join(parts: list[Any]) -> Any:
    """The rows of ``parts`` one after the other (tensors concatenated on dim 0, columns chained)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.ndim else first
    if is_column(first):
        return type(first)(value for part in parts for value in part)
    if _is_structure(first):
        keys = [k for k, _ in _children(first)]
        values = [join([part[k] for part in parts]) for k in keys]
        return _rebuild(first, dict(zip(keys, values, strict=True)) if isinstance(first, Mapping) else values)
    return first


def take(batch: Any, rows: slice | list[int]) -> Any:
    """The given rows of every tensor and column of ``batch`` (a slice is a view, a list of rows a copy)."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if not value.ndim:
                return value
            if isinstance(rows, slice):
                return value[rows]
            return value.index_select(0, torch.tensor(rows, dtype=torch.long, device=value.device))
        if is_column(value):
            return type(value)(value[rows] if isinstance(rows, slice) else [value[i] for i in rows])
        return value

    return _map(batch, cut)


def copy_rows(batch: Any) -> Any:
    """``batch`` with every tensor cloned, so that a few kept rows do not hold a whole batch's storage."""
    return _map(batch, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)


def describe(batch: Any) -> Any:
    """``batch`` with each tensor replaced by its :class:`TensorSpec` (picklable, small)."""
    return _map(batch, lambda v: TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v)


def allocate(spec: Any, device: torch.device | None) -> Any:
    """Empty tensors on ``device`` where :func:`describe` left a :class:`TensorSpec`."""
    return _map(spec, lambda v: torch.empty(v.shape, dtype=v.dtype, device=device) if isinstance(v, TensorSpec) else v)
