"""The Trainer's side of context parallelism: each batch made ready to split along the sequence (``shift_labels``
built before the split, global ``position_ids``, every sequence tensor padded to a multiple of the chunk count),
and evaluation's loss and logits put back together from the ``cp`` ranks' slices.

transformers' own ``_prepare_context_parallel_inputs`` builds ``shift_labels`` only for torch's backend, pads nothing
and refuses any non-causal 2-D mask; here padding masks and packed documents train exactly (``all_gather``), and
torch's backend, which cannot express them, refuses them in one line.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from trainer_ext.distributed.mesh.context_parallel import SequenceSplit
from trainer_ext.distributed.mesh.cp_batch import is_packed, prepare_batch
from trainer_ext.errors import ConfigError


class ContextParallelMixin:
    """Trainer hooks for ``cp_size > 1`` (no-ops without it)."""

    def _check_context_parallel_support(self) -> None:
        """Refuse cp on a transformers whose training step does not call the hook that splits the batch."""
        import transformers

        if getattr(self.accelerator, "cp_backend", None) is not None:
            if not hasattr(transformers.Trainer, "_prepare_context_parallel_inputs"):
                raise ConfigError(
                    f"cp_size > 1 needs a transformers whose Trainer splits batches for context parallelism; "
                    f"{transformers.__version__} does not: upgrade transformers, or set cp_size=1"
                )

    def _prepare_context_parallel_inputs(self, model: Any, inputs: dict[str, Any]) -> tuple[Callable, dict[str, Any]]:
        """The context that splits the batch for this ``cp`` rank, and the batch it splits (a padded copy)."""
        engine = self.accelerator
        if getattr(engine, "cp_backend", None) is None:
            return contextlib.nullcontext, inputs
        if inputs.get("labels") is None and inputs.get("shift_labels") is None:
            raise ConfigError(
                f"context parallelism splits a batch along the sequence, and this batch has no labels for a per-token "
                f"loss (keys: {', '.join(sorted(inputs))}): a loss over whole sequences (preference pairs, rewards) "
                "cannot be computed from a rank's slice; train it with cp_size=1"
            )
        split = SequenceSplit(engine.parallelism_config.cp_size)
        batch, buffers = prepare_batch(inputs, split, engine.cp_backend)
        context = functools.partial(
            engine.maybe_context_parallel,
            buffers=buffers,
            buffer_seq_dims=[1] * len(buffers),
            no_restore_buffers=set(buffers),
        )
        return context, batch

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """A packed batch runs without the model's key/value cache: transformers builds the block-causal mask of
        packed documents only without one, and a training forward otherwise makes one (documents would attend across
        their boundaries, as with stock transformers on SDPA/eager)."""
        inputs = super()._prepare_inputs(inputs)
        if is_packed(inputs) and "use_cache" not in inputs and _takes_use_cache(self.model):
            inputs = {**inputs, "use_cache": False}
        return inputs

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]:
        """transformers' step; under cp the loss is summed over the ``cp`` ranks' slices and the logits joined."""
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        engine = self.accelerator
        if getattr(engine, "cp_backend", None) is None:
            return loss, logits, labels
        import torch.distributed as dist

        cp = engine.parallel_mesh["cp"]
        if loss is not None:
            loss = loss.clone()
            dist.all_reduce(loss, group=cp.get_group())
            loss = loss / cp.size()
        if logits is not None:
            length = inputs["input_ids"].shape[1] if "input_ids" in inputs else None
            logits = _join(logits, cp, length)
        return loss, logits, labels


def _takes_use_cache(model: Any) -> bool:
    import inspect

    forward = getattr(getattr(model, "module", model), "forward", None)
    try:
        return forward is not None and "use_cache" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def _join(logits: Any, cp: Any, length: int | None) -> Any:
    """Every ``cp`` rank's slice of ``logits`` (a tensor or a tuple of them) as the whole sequence, unpadded."""
    import torch.distributed as dist

    if isinstance(logits, (tuple, list)):
        return type(logits)(_join(item, cp, length) for item in logits)
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        return logits
    parts = [torch.empty_like(logits) for _ in range(cp.size())]
    dist.all_gather(parts, logits.contiguous(), group=cp.get_group())
    joined = SequenceSplit(cp.size()).unshard(parts, 1)
    return joined if length is None else joined[:, :length]
