"""Per-rank memory under pipeline parallelism (``pp_size`` > 1), kept simple.

Each pipeline rank holds only its stages: the stages are the decoder layers split by
:func:`~trainer_ext.distributed.pipeline.split.balance` (balanced by parameter count, the first stage also holding
the embeddings, the last the final norm and head), placed on ranks by the schedule
(:func:`~trainer_ext.distributed.pipeline.schedules.stage_ids`: one stage per rank, or two for the interleaved,
looped and zero-bubble schedules). A rank's weights, gradients and optimizer states are those of its stages' layers
plus the embeddings or head it holds, sharded further over the data-parallel ranks as without a pipeline
(FSDP2 over ``dp_shard``).

Activations: each rank's batch is cut into ``pp_microbatches`` microbatches (default: one per stage); a stage keeps
the activations of the microbatches whose backward has not run yet. 1F1B and the interleaved and zero-bubble
schedules start backward as soon as the last stage can, so at most ``pp_size`` microbatches are in flight per stage;
GPipe and looped BFS run every forward first, so all of them are. Only the last stage holds the logits.

The estimate is the rank with the largest peak. The bubble (the share of a step each rank idles) is
:func:`~trainer_ext.distributed.pipeline.schedules.bubble_fraction`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from trainer_ext.distributed.pipeline.schedules import (
    bubble_fraction,
    default_microbatches,
    stage_ids,
    stages_per_rank,
)

if TYPE_CHECKING:
    from trainer_ext.estimate.setup import Setup
    from trainer_ext.estimate.shape import ModelShape

# schedules that run every microbatch's forward before any backward: all microbatches' activations are in flight
ALL_IN_FLIGHT = ("gpipe", "looped_bfs")


def microbatches(setup: Setup) -> int:
    """The microbatches each schedule run takes: ``pp_microbatches``, or the schedule's default."""
    return setup.pp_microbatches or default_microbatches(setup.pp_schedule, setup.pp_size)


def in_flight(setup: Setup, pp_rank: int | None = None) -> int:
    """Microbatches whose activations one stage keeps at once: all of them for GPipe and looped BFS, else at most
    ``pp_size``; with ``pp_rank``, that rank's under 1F1B: ``pp_size - pp_rank``.

    1F1B's rank ``r`` runs ``pp_size - 1 - r`` warm-up forwards, then one forward and one backward in turn, so it
    never holds more than ``pp_size - r`` microbatches (measured on gloo ranks: the first stage holds 2, the last 1
    at pp 2), and the last stage, which holds the logits, only one. The interleaved and zero-bubble schedules keep
    the bound ``pp_size`` for every rank (not measured)."""
    count = microbatches(setup)
    if setup.pp_schedule in ALL_IN_FLIGHT:
        return count
    if pp_rank is not None and setup.pp_schedule == "1f1b":
        return min(count, setup.pp_size - pp_rank)
    return min(count, setup.pp_size)


def outer_elements_not_saved(shape: ModelShape, setup: Setup, pp_rank: int) -> float:
    """Elements per token of the whole model's outside-the-layers activations
    (:func:`~trainer_ext.estimate.activations.outer_elements`) that rank ``pp_rank`` does not save: a rank without
    the last stage has no final norm, head or loss; it keeps the rotary tables it computes (cos and sin per
    position, ``2 * head_dim``) and, on the first stage, the token ids (int64, 2 elements of 4 bytes). Measured on
    gloo ranks, tiny-llama-untied at pp 2: the first stage's outside terms are ``2 * head_dim + 2`` to the element.
    The last stage keeps the whole model's (within 50 elements per token of it, on the safe side)."""
    from trainer_ext.estimate.activations import outer_elements

    stages = stage_ids(setup.pp_schedule, pp_rank, setup.pp_size)
    if setup.pp_size * stages_per_rank(setup.pp_schedule) - 1 in stages:
        return 0.0
    kept = 2 * shape.head_dim + (2 if 0 in stages else 0)
    return max(outer_elements(shape, setup.cp_size) - kept, 0.0)


def bubble(setup: Setup) -> float:
    """The share of a step each pipeline rank idles under the setup's schedule."""
    return bubble_fraction(setup.pp_schedule, setup.pp_size, microbatches(setup))


def _ends(shape: ModelShape) -> tuple[int, int]:
    """(embedding, norm + head) parameters: the first and the last stage's extras (the input embedding is
    vocabulary × hidden; the rest outside the layers is the last stage's)."""
    first = min(shape.vocab * shape.hidden, shape.outer_params)
    return first, shape.outer_params - first


def stage_ranges(shape: ModelShape, setup: Setup) -> list[tuple[int, int]]:
    """Each stage's decoder layers ``[start, end)``, balanced by parameter count as the pipeline splits them."""
    from trainer_ext.distributed.pipeline.split import balance

    stages = setup.pp_size * stages_per_rank(setup.pp_schedule)
    first, last = _ends(shape)
    return balance([shape.layer_params] * shape.num_layers, first, last, stages)


def _rank_shape(shape: ModelShape, ranges: list[tuple[int, int]], stages: list[int]) -> ModelShape:
    """The part of ``shape`` one rank holds: its stages' layers, the embeddings on stage 0, norm and head (and the
    logits) on the last; trainable and Adafactor counts in proportion."""
    first, last = _ends(shape)
    layers = sum(ranges[s][1] - ranges[s][0] for s in stages)
    holds_last = len(ranges) - 1 in stages
    params = layers * shape.layer_params + (first if 0 in stages else 0) + (last if holds_last else 0)
    share = params / max(shape.params, 1)
    return dataclasses.replace(
        shape,
        params=params,
        trainable=round(shape.trainable * share),
        factored_trainable=round(shape.factored_trainable * share),
        num_layers=layers,
        blocks_params=layers * shape.layer_params,
        causal_lm=shape.causal_lm and holds_last,
        vocab=shape.vocab if holds_last else 0,
        # the tensor-parallel plan splits the rank's layers (and the embeddings or head where it names them)
        tp_params=round(shape.tp_params * share),
        tp_trainable=round(shape.tp_trainable * share),
        tp_layer_params=shape.tp_layer_params,
    )


def rank_parts(shape: ModelShape, setup: Setup, batch: int) -> tuple[list[ModelShape], Setup, int, int]:
    """What each pipeline rank estimates as a job of its own at a per-rank batch of ``batch`` sequences: the parts
    of ``shape`` the ranks hold, the setup of one stage's data-parallel job (one microbatch per micro-batch), the
    sequences per microbatch and the microbatches in flight its activations are multiplied by.
    :func:`trainer_ext.estimate.breakdown.estimate` takes the rank with the largest peak."""
    ranges = stage_ranges(shape, setup)
    micro = -(-batch // microbatches(setup))  # sequences per microbatch
    # the stage's data-parallel world: FSDP2 shards each stage over the ranks that hold the same one
    inner = setup.replace(pp_size=1, world_size=max(setup.world_size // setup.pp_size, 1), micro_batch=micro)
    if inner.strategy == "ddp" and inner.data_parallel == 1:  # the pipeline alone: no gradient buckets
        inner = inner.replace(strategy="single")
    parts = [_rank_shape(shape, ranges, stage_ids(setup.pp_schedule, r, setup.pp_size)) for r in range(setup.pp_size)]
    return parts, inner, micro, in_flight(setup)


def describe(setup: Setup, shape: ModelShape | None = None) -> str:
    """The pipeline in one phrase: stages (with their layers when ``shape`` is given), schedule, microbatches,
    bubble, e.g. ``2 stages (layers 0-3 | 4-7), 1f1b, 4 microbatches, bubble 20%``."""
    from trainer_ext.distributed.pipeline.schedules import describe as phrase

    stages = setup.pp_size * stages_per_rank(setup.pp_schedule)
    ranges = stage_ranges(shape, setup) if shape is not None and shape.num_layers >= stages else None
    return phrase(setup.pp_size, setup.pp_schedule, setup.pp_microbatches, ranges)
