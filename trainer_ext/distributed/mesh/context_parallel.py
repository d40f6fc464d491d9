"""Context parallelism: each rank of the mesh's ``cp`` dimension holds a slice of every sequence, and attention
brings the other ranks' keys and values to its queries.

The split is load-balanced for causal attention: a sequence is cut into ``2 × cp`` chunks and rank ``r`` holds
chunks ``r`` and ``2·cp − 1 − r``, so every rank attends over the same number of (query, key) pairs. Two backends run
the attention behind one interface (``cp_attention``): torch's ``context_parallel`` (ring attention over SDPA, CUDA
only) and ``all_gather`` (ours: keys and values all-gathered with autograd, an offset causal mask built from the
global token positions; runs on every device, and handles padding and packed documents).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer_ext.errors import ConfigError

BACKENDS = ("torch", "all_gather")


def resolve_backend(requested: str, device_type: str) -> str:
    """``auto`` as the backend this device runs (torch's ring attention on CUDA, ours elsewhere); a forced ``torch``
    on another device is refused in one line."""
    if requested == "auto":
        return "torch" if device_type == "cuda" else "all_gather"
    if requested == "torch" and device_type != "cuda":
        raise ConfigError(
            f"cp_backend='torch' runs torch's context_parallel, which has no {device_type} kernel (torch 2.13): use "
            "cp_backend='all_gather' or 'auto'"
        )
    return requested


@dataclass(frozen=True)
class SequenceSplit:
    """Which global positions of a sequence each of ``cp_size`` ranks holds (head-tail when ``load_balance``)."""

    cp_size: int
    load_balance: bool = True

    @property
    def multiple(self) -> int:
        """Sequence lengths must be a multiple of this: the number of chunks."""
        return 2 * self.cp_size if self.load_balance else self.cp_size

    def indices(self, rank: int, length: int, device: Any = None) -> torch.Tensor:
        """The global positions ``rank`` holds, in its local order."""
        chunk = length // self.multiple
        if not self.load_balance:
            return torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        tail = self.multiple - 1 - rank
        head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        return torch.cat([head, torch.arange(tail * chunk, (tail + 1) * chunk, device=device)])

    def gathered_indices(self, length: int, device: Any = None) -> torch.Tensor:
        """The global position of each slot of the rank-ordered concatenation of every rank's slice."""
        return torch.cat([self.indices(rank, length, device) for rank in range(self.cp_size)])

    def shard(self, tensor: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """``rank``'s slice of ``tensor`` along ``dim`` (a new tensor)."""
        length = tensor.shape[dim]
        return tensor.index_select(dim, self.indices(rank, length, tensor.device))

    def unshard(self, parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """The whole sequence, in global order, from every rank's slice (in rank order)."""
        joined = torch.cat(list(parts), dim=dim)
        order = torch.argsort(self.gathered_indices(joined.shape[dim], joined.device))
        return joined.index_select(dim, order)

    def check_length(self, length: int) -> None:
        """ConfigError unless ``length`` splits into this many equal chunks."""
        if length % self.multiple:
            raise ConfigError(
                f"context parallelism splits each sequence into {self.multiple} equal chunks, and this batch has "
                f"{length} positions: pad the batch to a multiple of {self.multiple} (pad_to_multiple_of="
                f"{self.multiple} in the data collator)"
            )


@dataclass
class Active:
    """The context-parallel region the attention function is in: the ``cp`` group, this rank, the split."""

    group: Any
    rank: int
    split: SequenceSplit
    backend: str
    buffers: tuple[torch.Tensor, ...] = ()
    cache: dict[str, Any] = field(default_factory=dict)


_ACTIVE: list[Active] = []


def active() -> Active | None:
    """The innermost context-parallel region entered on this process, or None outside one."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def _entered(region: Active) -> Iterator[None]:
    _ACTIVE.append(region)
    try:
        yield
    finally:
        _ACTIVE.pop()


def _replace(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Point ``tensor`` at ``value``'s data in place (what torch's context_parallel does to its buffers)."""
    with torch.no_grad():
        tensor.set_(value.contiguous())


@contextlib.contextmanager
def context_parallel(
    cp_mesh: Any,
    buffers: Sequence[torch.Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: Any = None,
    *,
    backend: str = "all_gather",
    load_balance: bool = True,
) -> Iterator[None]:
    """Shard ``buffers`` in place along their sequence dimension for this ``cp`` rank, run the block with
    context-parallel attention, then restore the buffers not in ``no_restore_buffers`` (accelerate's semantics)."""
    buffers = list(buffers or ())
    dims = list(buffer_seq_dims) if buffer_seq_dims is not None else [1] * len(buffers)
    if len(dims) != len(buffers):
        raise ConfigError(
            f"maybe_context_parallel: {len(buffers)} buffers but {len(dims)} buffer_seq_dims; give one dimension each"
        )
    keep = {id(b) for b in (no_restore_buffers or ())}
    split = SequenceSplit(cp_mesh.size(), load_balance)
    lengths = {b.shape[d] for b, d in zip(buffers, dims, strict=True)}
    if len(lengths) > 1:
        raise ConfigError(
            f"maybe_context_parallel: the buffers' sequence lengths differ ({sorted(lengths)}); pass tensors of one batch"
        )
    for length in lengths:
        split.check_length(length)
    region = Active(cp_mesh.get_group(), cp_mesh.get_local_rank(), split, backend)
    if backend == "torch":
        from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

        restore = set(no_restore_buffers or ())
        with torch_context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers=restore):
            region.buffers = tuple(buffers)
            with _entered(region):
                yield
        return
    saved = [(b, b.clone()) for b in buffers if id(b) not in keep]
    for buffer, dim in zip(buffers, dims, strict=True):
        _replace(buffer, split.shard(buffer, dim, region.rank))
    region.buffers = tuple(buffers)
    try:
        with _entered(region):
            yield
    finally:
        for buffer, original in saved:
            _replace(buffer, original)
