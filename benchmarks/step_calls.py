"""Count what a training step calls that can make a rank wait: collectives and host reads of tensors.

``python -m benchmarks.strategies --count_calls`` runs each runner once with these counters on from the end of the
warm-up to the last step and prints the calls per optimizer step, so the loops of the raw engines, trainer_ext and
transformers' Trainer can be compared call by call. No rate is taken in that mode: counting costs time.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

# torch.distributed's collectives; a call made inside another counted one (all_gather_into_tensor goes through
# all_gather_single) is not counted again
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "reduce",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "scatter",
    "all_to_all_single",
    "barrier",
)
# Tensor methods that bring a value to Python: a wait for the device when the tensor lives on one
HOST_READS = ("item", "tolist", "__bool__")


class CallCounter:
    """Counters patched into ``torch.distributed`` and ``torch.Tensor``, counting while ``active``."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.active = False
        self.steps = 0
        self.at_last_step: Counter[str] = Counter()  # the counts when the last step ended (not the teardown's)
        self._depth = 0
        self._originals: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        """Wrap the collectives and host reads of this process (a benchmark child's, until :meth:`uninstall`)."""
        import torch
        import torch.distributed as dist

        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._patch(dist, name, self._collective(name, getattr(dist, name)))
        for name in HOST_READS:
            self._patch(torch.Tensor, name, self._host_read(name, getattr(torch.Tensor, name)))

    def uninstall(self) -> None:
        """Put the original functions back."""
        while self._originals:
            owner, name, original = self._originals.pop()
            setattr(owner, name, original)

    def _patch(self, owner: Any, name: str, wrapper: Any) -> None:
        self._originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def _collective(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active and self._depth == 0:
                self.counts[name] += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def _host_read(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.counts[f"{name.strip('_')} ({tensor.device.type})"] += 1
            return fn(tensor, *args, **kwargs)

        return counted

    def on_tick(self, step: int, warmup: int) -> None:
        """Called by the benchmark clock after each optimizer step: count from the warm-up's end on."""
        if step == warmup:
            self.active = True
        elif self.active:
            self.steps += 1
            self.at_last_step = Counter(self.counts)

    def per_step(self) -> dict[str, float]:
        """Calls per counted optimizer step, by name."""
        if not self.steps:
            return {}
        return {name: round(n / self.steps, 2) for name, n in sorted(self.at_last_step.items())}
