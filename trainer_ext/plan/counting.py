"""Counting the collectives a process really runs, in bytes, by watching the dispatcher.

:class:`CollectiveCounter` is a ``TorchDispatchMode``: while it is entered, every operator the process dispatches on
its thread (and in the autograd work backward does on it) passes through it. It records the ``c10d`` operators
(what ``torch.distributed``'s calls, DDP's reducer, DeepSpeed and FSDP2 issue: ``allreduce_``, ``_allgather_base_``,
``_reduce_scatter_base_``, ``send``, ...) and the functional ones DTensor and tensor parallelism issue
(``_c10d_functional.all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ...). A functional
collective runs its ``c10d`` operator inside the mode's handler, where the mode is not active: each collective is
counted once. An operator on a tensor subclass (DTensor) is handed back to the subclass (``NotImplemented``), so the
collectives DTensor runs inside its own dispatch (an implicit redistribution) are seen too (other subclasses,
such as the fake tensors DTensor propagates shapes with, are left to run under the mode).

Bytes follow one convention, the same as :mod:`trainer_ext.plan.comms`' model: ``all_reduce`` the tensor's bytes,
``all_gather`` the whole gathered output's, ``reduce_scatter`` the whole input's, ``send_recv`` the bytes this rank
sends (received bytes are kept apart under ``recv``), ``broadcast`` and ``reduce`` the tensor's, ``all_to_all`` the
input's. Work running on threads the mode does not reach (a communication thread of its own) is not seen.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# c10d operator -> (collective, the argument holding the tensors its bytes are read from: a tensor, a list of them
# or a list of lists; -1 for none)
_C10D: dict[str, tuple[str, int]] = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "send": ("send_recv", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 1),
    "barrier": ("barrier", -1),
    "monitored_barrier_": ("barrier", -1),
}
# functional operator -> (collective, times the group size: an all-gather's output is group_size x its input)
_FUNCTIONAL: dict[str, tuple[str, bool]] = {
    "all_reduce": ("all_reduce", False),
    "all_reduce_": ("all_reduce", False),
    "all_reduce_coalesced": ("all_reduce", False),
    "all_reduce_coalesced_": ("all_reduce", False),
    "all_gather_into_tensor": ("all_gather", True),
    "all_gather_into_tensor_out": ("all_gather", True),
    "all_gather_into_tensor_coalesced": ("all_gather", True),
    "reduce_scatter_tensor": ("reduce_scatter", False),
    "reduce_scatter_tensor_out": ("reduce_scatter", False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", False),
    "all_to_all_single": ("all_to_all", False),
    "shard_dim_alltoall": ("all_to_all", False),
    "broadcast": ("broadcast", False),
    "broadcast_": ("broadcast", False),
    "isend": ("send_recv", False),
    "irecv": ("recv", False),
}


@dataclass(frozen=True)
class Call:
    """One kind of collective over one group: what :class:`CollectiveCounter` keys its totals by."""

    collective: str
    group_size: int
    ranks: tuple[int, ...]  # the group's global ranks; () when they could not be read


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or nested lists of them); a DTensor by its local part."""
    total = 0
    for tensor in _tensors(value):
        local = tensor.to_local() if callable(getattr(tensor, "to_local", None)) else tensor
        total += local.numel() * local.element_size()
    return total


def _group_of(args: Iterable[Any]) -> Any:
    """The ProcessGroup among a c10d operator's arguments (a script object of class ProcessGroup)."""
    import torch.distributed as dist

    for arg in args:
        if isinstance(arg, dist.ProcessGroup):
            return arg
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except (AttributeError, RuntimeError, TypeError):
                continue
    return None


def _group_named(name: Any) -> Any:
    from torch.distributed import distributed_c10d

    if not isinstance(name, str):
        return name
    try:
        return distributed_c10d._resolve_process_group(name)
    except (KeyError, RuntimeError, ValueError):
        return None


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group`` in group-rank order; () when they cannot be read."""
    import torch.distributed as dist

    if group is None:
        return ()
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, KeyError):
        return ()


def _size(group: Any) -> int:
    try:
        return int(group.size())
    except (AttributeError, RuntimeError):
        return 0


@functools.cache
def _dtensor_class() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


class CollectiveCounter(TorchDispatchMode):
    """Counts the bytes and calls of every collective while entered, per :class:`Call` (collective and group).

    ``with CollectiveCounter() as counter: ...`` then :meth:`by_collective` (bytes per collective),
    :meth:`by_dimension` (bytes per collective and mesh dimension, given a map of group ranks to dimension names)
    or :attr:`bytes` / :attr:`calls` per :class:`Call`. Entering again adds to the totals; :meth:`reset` clears them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[Call, int] = {}
        self.calls: dict[Call, int] = {}
        self._ranks: dict[Any, tuple[int, ...]] = {}  # group name -> its global ranks

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def _record(self, collective: str, group: Any, size: int, nbytes: int) -> None:
        key = getattr(group, "group_name", None) or id(group)  # a group's Python wrapper may be a new object per call
        if key not in self._ranks:
            self._ranks[key] = group_ranks(group)
        call = Call(collective, size or len(self._ranks[key]), self._ranks[key])
        self.bytes[call] = self.bytes.get(call, 0) + int(nbytes)
        self.calls[call] = self.calls.get(call, 0) + 1

    def _count(self, func: Any, args: tuple[Any, ...]) -> None:
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "c10d" and name in _C10D:
            collective, index = _C10D[name]
            group = _group_of(args)
            self._record(collective, group, _size(group), tensor_bytes(args[index]) if index >= 0 else 0)
        elif namespace in ("_c10d_functional", "_dtensor") and name in _FUNCTIONAL:
            collective, gathered = _FUNCTIONAL[name]
            group = _group_named(args[-1])  # every functional collective takes its group's name last
            size = _size(group)
            nbytes = tensor_bytes(args[0]) * (size if gathered else 1)
            self._record(collective, group, size, nbytes)
        elif namespace == "_c10d_functional" and name == "batch_p2p_ops":
            ops, tensors, group = args[0], args[3], _group_named(args[4])
            for op, tensor in zip(ops, tensors, strict=False):
                kind = "send_recv" if "send" in op else "recv"
                self._record(kind, group, _size(group), tensor_bytes(tensor))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional", "_dtensor"):
            self._count(func, args)
        elif any(issubclass(t, _dtensor_class()) for t in types):
            # DTensor dispatches the op itself: the redistributions it runs inside happen under this mode then
            return NotImplemented
        return func(*args, **kwargs)

    def by_collective(self, include_recv: bool = False) -> dict[str, int]:
        """Bytes per collective over every group (received bytes left out unless ``include_recv``; barriers, which
        carry none, always)."""
        out: dict[str, int] = {}
        for call, nbytes in self.bytes.items():
            if call.collective == "barrier" or (call.collective == "recv" and not include_recv):
                continue
            out[call.collective] = out.get(call.collective, 0) + nbytes
        return out

    def by_dimension(self, dimensions: dict[tuple[int, ...], str]) -> dict[str, dict[str, int]]:
        """Bytes per collective and per mesh dimension: ``dimensions`` maps a group's sorted global ranks to its
        dimension's name; a group it does not name is keyed ``ranks a,b,...``."""
        out: dict[str, dict[str, int]] = {}
        for call, nbytes in self.bytes.items():
            if call.collective in ("recv", "barrier"):
                continue
            ranks = tuple(sorted(call.ranks))
            name = dimensions.get(ranks) or ("ranks " + ",".join(map(str, ranks)) if ranks else "unknown")
            per = out.setdefault(call.collective, {})
            per[name] = per.get(name, 0) + nbytes
        return out

    def table(self) -> list[dict[str, Any]]:
        """Every (collective, group) with its bytes and calls, as JSON-ready rows."""
        return [
            {
                "collective": c.collective,
                "group_size": c.group_size,
                "ranks": list(c.ranks),
                "bytes": b,
                "calls": self.calls[c],
            }
            for c, b in sorted(self.bytes.items(), key=lambda item: (item[0].collective, item[0].ranks))
        ]
