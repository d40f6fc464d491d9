"""The shuffle order of a plain ``RandomSampler``, as accelerate leaves it, made resumable.

Without a seedable sampler (accelerate's default for hand-written loops) a shuffled loader keeps torch's
``RandomSampler``: on one process it draws a fresh seed from the global RNG at the start of each pass; on
several, it gets a generator seeded once at ``prepare`` and every pass starts from the main process's generator
state (``rng_types=["generator"]``). :class:`PassOrder` reproduces both exactly and remembers what the pass
being read started from, so a saved position resumes the same order, not a new one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import RandomSampler

RNG_TYPES = ("torch", "cuda", "generator")
_END = object()


def draw_seed() -> int:
    """A seed from the global RNG, drawn the way ``RandomSampler`` draws its own (same value, same RNG use)."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def plain_random_sampler(batch_sampler: Any) -> RandomSampler | None:
    """The batch sampler's sampler when it is torch's own ``RandomSampler`` (not a seedable subclass)."""
    sampler = getattr(batch_sampler, "sampler", None)
    return sampler if type(sampler) is RandomSampler else None


def give_generator(batch_sampler: Any) -> torch.Generator | None:
    """accelerate's preparation on several processes: a sampler with a ``generator`` attribute left None gets one,
    seeded from the global RNG now; it is the generator every pass synchronises. Returns it (None: no such sampler)."""
    sampler = getattr(batch_sampler, "sampler", None)
    if sampler is None or not hasattr(sampler, "generator"):
        return None
    if sampler.generator is None:
        sampler.generator = torch.Generator().manual_seed(draw_seed())
    return sampler.generator


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None, device: torch.device) -> None:
    """Every process takes the main process's state of each RNG named (accelerate's ``rng_types``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    for kind in rng_types:
        if kind == "generator" and generator is not None:
            generator.set_state(_broadcast(generator.get_state(), device))
        elif kind == "torch":
            torch.set_rng_state(_broadcast(torch.get_rng_state(), device))
        elif kind == "cuda" and torch.cuda.is_available():
            torch.cuda.set_rng_state(_broadcast(torch.cuda.get_rng_state(), device))


def _broadcast(state: torch.Tensor, device: torch.device) -> torch.Tensor:
    on_device = state.to(device)  # NCCL needs it on the GPU; gloo takes it where it is
    torch.distributed.broadcast(on_device, src=0)
    return on_device.cpu()


class PassOrder:
    """Where the current pass's order came from (a drawn seed, or the generator's state at its start), and what
    the next pass must start from after ``restore``."""

    def __init__(self) -> None:
        self.seed: int | None = None  # drawn for the pass being read (generator-less sampler)
        self.generator_state: torch.Tensor | None = None  # the sampler's generator at the start of that pass
        self.pending: dict[str, Any] = {}  # restored from a checkpoint: used by the next pass, once

    def batches(self, batch_sampler: Any, make: Iterator[list[int]]) -> Iterator[list[int]]:
        """``make`` (the pass's global batches) with the sampler's order fixed as recorded or restored."""
        sampler = plain_random_sampler(batch_sampler)
        pending, self.pending = self.pending, {}
        self.seed = self.generator_state = None
        if sampler is None:
            yield from make
            return
        if sampler.generator is not None:
            if "generator_state" in pending:
                sampler.generator.set_state(pending["generator_state"])
            elif "seed" in pending:  # saved by one process: the seed it drew for this pass
                sampler.generator.manual_seed(pending["seed"])
            self.generator_state = sampler.generator.get_state()
            yield from make
            return
        lent = torch.Generator()
        if "generator_state" in pending:  # saved by several processes: the pass's generator state
            self.generator_state = pending["generator_state"]
            lent.set_state(self.generator_state)
        else:
            self.seed = pending["seed"] if "seed" in pending else draw_seed()
            lent.manual_seed(self.seed)
        sampler.generator = lent
        try:  # the sampler reads its generator once, when it starts: lend ours for that first batch only
            first = next(make, _END)
        finally:
            sampler.generator = None
        if first is not _END:
            yield first
            yield from make

    def state(self, batch_sampler: Any, pass_started: bool, pass_finished: bool) -> dict[str, Any]:
        """What to save so the next pass after a restore reads the same order as this run would."""
        if self.pending:
            return dict(self.pending)
        sampler = plain_random_sampler(batch_sampler)
        if sampler is None or not pass_started:
            return {}
        if sampler.generator is not None:  # mid-pass: its start; finished: where the next one starts
            state = sampler.generator.get_state() if pass_finished else self.generator_state
            return {} if state is None else {"generator_state": state.clone()}
        if pass_finished:
            return {}  # the next pass draws from the global RNG, which the checkpoint restores
        if self.seed is not None:
            return {"seed": self.seed}
        return {} if self.generator_state is None else {"generator_state": self.generator_state.clone()}

    def restore(self, saved: dict[str, Any]) -> None:
        self.pending = {k: saved[k] for k in ("seed", "generator_state") if k in saved}

    def hand_over(self) -> dict[str, Any]:
        """Take the restored order away from this loader (a skipping copy reads the resumed pass instead)."""
        pending, self.pending = self.pending, {}
        return pending
