"""Collectives over nested tensors: gather, reduce, broadcast, pad_across_processes, device moves.

Every function is a no-op (or identity) for one process, so the same code runs everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def recursively_apply(func: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Apply ``func`` to every tensor in nested lists, tuples and mappings, keeping their types."""
    if isinstance(data, torch.Tensor):
        return func(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(recursively_apply(func, d) for d in data))
    if isinstance(data, (list, tuple)):
        return type(data)(recursively_apply(func, d) for d in data)
    if isinstance(data, Mapping):
        out = {k: recursively_apply(func, v) for k, v in data.items()}
        try:
            return type(data)(out)
        except TypeError:
            return out
    return data


def send_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in ``data`` to ``device``."""
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), data)


def _gather_tensor(tensor: torch.Tensor, into_one: bool | None = None) -> torch.Tensor:
    """All-gather along dim 0. ``into_one`` (default: for tensors off the CPU) gathers straight into one output
    tensor, as accelerate does on NCCL: no per-rank buffers, no concatenation. CPU tensors go through gloo (also
    in a group made with no backend named, whose ``get_backend()`` is ``undefined``), where the list form measured
    faster. The result carries no gradient (a gather is not differentiable): views of tensors that need one are
    read detached."""
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    tensor = tensor.detach().contiguous()
    world = dist.get_world_size()
    if into_one is None:
        into_one = tensor.device.type != "cpu" and dist.get_backend() != "gloo"
    if into_one:
        out = tensor.new_empty((world * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor)
        return out
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=0)


def gather(data: Any, every: int = 1) -> Any:
    """All-gather tensors (same shape on every rank) and concatenate along dim 0; 0-dim → 1-D. ``every`` > 1 keeps
    the parts of every ``every``-th rank only (one of each group of neighbouring ranks that hold the same data)."""
    if not _distributed():
        return recursively_apply(lambda t: t.reshape(1) if t.ndim == 0 else t, data)

    def _gather(t: torch.Tensor) -> torch.Tensor:
        out = _gather_tensor(t)
        if every == 1:
            return out
        return out.reshape(dist.get_world_size(), -1, *out.shape[1:])[::every].reshape(-1, *out.shape[1:])

    return recursively_apply(_gather, data)


def gather_object(obj: Any, every: int = 1) -> Any:
    """All-gather a picklable iterable from every rank (every ``every``-th rank's kept) and flatten one level; one
    process: ``obj`` unchanged."""
    if not _distributed():
        return obj
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return [x for o in out[::every] for x in o]


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """All-reduce tensors with ``sum`` or ``mean`` (then times ``scale``)."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', not {reduction!r}")

    def _reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if _distributed():
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
            if reduction == "mean":
                out = out / dist.get_world_size()
        return out * scale if scale != 1.0 else out

    return recursively_apply(_reduce, data)


def broadcast(data: Any, from_process: int = 0) -> Any:
    """Broadcast tensors in place from ``from_process`` to all ranks."""

    def _bcast(t: torch.Tensor) -> torch.Tensor:
        if _distributed():
            dist.broadcast(t, src=from_process)
        return t

    return recursively_apply(_bcast, data)


def broadcast_object_list(objects: list[Any], from_process: int = 0) -> list[Any]:
    """Broadcast a list of picklable objects in place."""
    if _distributed():
        dist.broadcast_object_list(objects, src=from_process)
    return objects


def pad_across_processes(data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad every tensor along ``dim`` to the largest size on any rank, so they can be gathered."""

    def _pad(t: torch.Tensor) -> torch.Tensor:
        if not _distributed() or t.ndim == 0 or dim >= t.ndim or dim < -t.ndim:
            return t
        d = dim % t.ndim
        size = torch.tensor([t.shape[d]], device=t.device)
        sizes = _gather_tensor(size)
        longest = int(sizes.max())
        if longest == t.shape[d]:
            return t
        shape = list(t.shape)
        shape[d] = longest
        out = t.new_full(shape, pad_index)
        index = [slice(None)] * t.ndim
        index[d] = slice(longest - t.shape[d], longest) if pad_first else slice(0, t.shape[d])
        out[tuple(index)] = t
        return out

    return recursively_apply(_pad, data)


def truncate_rows(data: Any, rows: int) -> Any:
    """Keep the first ``rows`` rows of every tensor (and of lists), dropping duplicated padding."""

    def _cut(t: Any) -> Any:
        return t[:rows]

    if isinstance(data, list) and data and not isinstance(data[0], torch.Tensor):
        return data[:rows]
    return recursively_apply(_cut, data)
