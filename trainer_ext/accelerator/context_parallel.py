"""A hand-written loop's batch under context parallelism, made the way the Trainer makes it: ``shift_labels`` built
before the split, global ``position_ids``, every sequence tensor padded to a multiple of ``2 × cp_size``, and the
loss normalised by the token count of the whole data-parallel batch, so that ``cp × dp`` ranks train what one
process trains on the concatenated batch.

    prepared = context_parallel_batch(batch, accelerator)
    with accelerator.maybe_context_parallel(
        buffers=prepared.buffers, buffer_seq_dims=[1] * len(prepared.buffers), no_restore_buffers=set(prepared.buffers)
    ):
        loss = model(**prepared.inputs).loss * prepared.loss_scale
        accelerator.backward(loss)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from trainer_ext.distributed.mesh.context_parallel import SequenceSplit
from trainer_ext.distributed.mesh.cp_batch import IGNORE_INDEX, prepare_batch
from trainer_ext.errors import ConfigError


class ContextParallelBatch(NamedTuple):
    """The model's inputs (``num_items_in_batch`` among them), the tensors ``maybe_context_parallel`` shards along
    dimension 1, and the factor that undoes the gradient average over the data-parallel and ``cp`` ranks."""

    inputs: dict[str, Any]
    buffers: list[torch.Tensor]
    loss_scale: int


def context_parallel_batch(
    batch: dict[str, Any], accelerator: Any, num_items_in_batch: int | torch.Tensor | None = None
) -> ContextParallelBatch:
    """``batch`` ready for ``maybe_context_parallel`` (a padded copy; without cp the batch as it is), with
    ``num_items_in_batch``: the labelled tokens of this micro-batch on every data-parallel rank (or the count given)."""
    engine = getattr(accelerator, "engine", accelerator)
    config = engine.parallelism_config
    if engine.cp_backend is not None:
        inputs, buffers = prepare_batch(batch, SequenceSplit(config.cp_size), engine.cp_backend)
    else:
        inputs, buffers = dict(batch), []
    if num_items_in_batch is None:
        num_items_in_batch = _labelled_tokens(inputs, engine)
    inputs["num_items_in_batch"] = num_items_in_batch
    # FSDP2/DDP average gradients over every rank but the tensor-parallel ones (they hold one batch and one slice)
    scale = engine.num_processes if config is None else engine.num_processes // (config.tp_size * config.sp_size)
    return ContextParallelBatch(inputs, buffers, scale)


def _labelled_tokens(inputs: dict[str, Any], engine: Any) -> torch.Tensor:
    """Labels other than -100 after the shift, summed over the ranks that read different batches."""
    labels = inputs.get("shift_labels")
    if labels is None and inputs.get("labels") is not None:
        labels = inputs["labels"][:, 1:]
    if labels is None:
        raise ConfigError(
            "context_parallel_batch counts the labelled tokens to normalise the loss, and this batch has no labels "
            "or shift_labels: add labels, or pass num_items_in_batch"
        )
    count = labels.ne(IGNORE_INDEX).sum().to(engine.device)
    if engine.num_processes > 1:
        import torch.distributed as dist

        dist.all_reduce(count)
        count = count // engine.same_batch_size  # the cp and tp ranks of one group counted the same batch
    return count
