"""How many bytes each rank communicates per optimizer step, by collective and mesh dimension.

:func:`step_traffic` models the collectives trainer_ext's engine runs for a job (a :class:`Setup` on a
:class:`ModelShape`), counted over one optimizer step (every accumulation micro-batch), for the busiest rank:

- DDP: one all-reduce of the trainable gradients (fp32) per step (``no_sync`` skips the window's earlier
  micro-batches).
- FSDP2: per micro-batch, an all-gather of every parameter in forward and again of the decoder layers' in backward
  when ``reshard_after_forward`` (the root stays gathered); in the compute dtype under ``--bf16``/``--fp16``. One
  reduce-scatter of the gradients (fp32) per step; HSDP adds an all-reduce of the shard over ``dp_replicate``.
  Under pipeline parallelism each stage is gathered once per schedule run and reduce-scattered every micro-batch.
- DeepSpeed (gradients and parameters in its compute dtype): ZeRO-0/1 all-reduce the gradients once per step, ZeRO-2
  every micro-batch (its default bucketed all-reduce); ZeRO-1/2 all-gather the updated parameters after the step.
  ZeRO-3 all-gathers the parameters in every forward (again in backward only for layers further apart than
  DeepSpeed's default reuse distance of 1e9 parameters) and reduce-scatters the gradients every micro-batch.
  Offloading moves the same bytes.
- Tensor parallelism (torch's colwise/rowwise styles on the model's own plan, llama-like layers): per layer, forward
  all-reduces the two row-parallel outputs, backward the input gradient of each column-parallel linear (q, k, v,
  gate, up); the vocabulary-split embedding all-reduces its output, and a causal LM's lm_head all-gathers its logits
  and all-reduces its input gradient. Activation checkpointing repeats the forward's all-reduces.
- Context parallelism, ``all_gather`` backend: per layer, keys and values all-gathered in forward (grouped heads
  kept) and their gradients all-reduced in backward; positions and the padding mask gathered once per forward.
  The ``torch`` backend (ring attention, CUDA) is modelled as gathering the repeated heads in forward and again in
  backward, plus a reduce-scatter of their gradients: not checked against a run.
- Pipeline parallelism: per microbatch, each stage sends its output activations (float32) to the next stage's rank
  and the gradient of its input back; the rank with the most sends is the busiest.

Small collectives are left out: the gradient-norm all-reduce (a few bytes per mesh), the pipeline's loss
broadcast, DDP's buffer and bucket broadcasts; so are the loss and token-count gathers the Trainer runs for
logging. Bytes follow one buffer convention (:mod:`trainer_ext.plan.counting` counts the same way): all_reduce the
tensor's bytes, all_gather the whole gathered output's, reduce_scatter the whole input's, send_recv the bytes the
rank sends, broadcast the tensor's, all_to_all the input's. :func:`wire_bytes` turns one into what the rank puts on
the wire under ring algorithms.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer_ext.estimate.setup import Setup
    from trainer_ext.estimate.shape import ModelShape

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast", "all_to_all", "reduce")
# linears per decoder layer whose input gradient tensor parallelism all-reduces (column-parallel) and whose output
# it all-reduces (row-parallel): llama-like q, k, v, gate, up / o, down; fused projections have fewer
COLWISE_PER_LAYER = {"gpt2": 2, "gpt_neox": 2, "phi3": 2, "bloom": 2, "falcon": 2}
DEFAULT_COLWISE = 5
ROWWISE_PER_LAYER = 2
ZERO3_REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's stage3_max_reuse_distance default (parameters)
FLOAT32 = 4
POSITION_BYTES = 8  # int64 position ids
# the engine's flattened views, after the plain dimensions (a group both name keeps the plain name)
FLATTENED = (
    ("dp_shard_cp", ("dp_shard", "cp")),
    ("dp", ("dp_replicate", "dp_shard")),
    ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
)


@dataclass(frozen=True)
class Traffic:
    """One collective's bytes per rank per optimizer step, over one mesh dimension."""

    dimension: str  # "dp" (no mesh), "dp_replicate", "dp_shard", "tp", "cp", "pp", or a flattened "dp_shard_cp"
    collective: str  # one of COLLECTIVES
    group_size: int
    bytes: int  # the buffer convention of the module docstring


def wire_bytes(traffic: Traffic) -> float:
    """Bytes one rank sends for ``traffic`` with ring algorithms: all-reduce 2(n−1)/n·B, all-gather, reduce-scatter,
    all-to-all and reduce (n−1)/n·B, send/recv and broadcast B."""
    n = max(traffic.group_size, 1)
    if traffic.collective == "all_reduce":
        return 2 * (n - 1) / n * traffic.bytes
    if traffic.collective in ("all_gather", "reduce_scatter", "all_to_all", "reduce"):
        return (n - 1) / n * traffic.bytes
    return float(traffic.bytes)


def by_collective(traffic: Iterable[Traffic]) -> dict[str, int]:
    """Bytes per collective, summed over dimensions."""
    out: dict[str, int] = {}
    for item in traffic:
        out[item.collective] = out.get(item.collective, 0) + item.bytes
    return out


def total_wire_bytes(traffic: Iterable[Traffic]) -> float:
    return sum(wire_bytes(item) for item in traffic)


# -- the pieces -------------------------------------------------------------------------------------------------------
class _Steps:
    """Collects traffic, merging entries of one (dimension, collective, group)."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str, int], float] = {}

    def add(self, dimension: str, collective: str, group: int, nbytes: float) -> None:
        if group > 1 and nbytes > 0:
            key = (dimension, collective, group)
            self.items[key] = self.items.get(key, 0.0) + nbytes

    def traffic(self) -> list[Traffic]:
        return [Traffic(d, c, g, round(b)) for (d, c, g), b in self.items.items()]


def _low_precision(setup: Setup) -> bool:
    return setup.precision in ("bf16", "fp16")


def _fsdp_group(setup: Setup) -> int:
    """Ranks FSDP2 shards each parameter over: dp_shard × cp (the world without replicas, tp and pp)."""
    return max(setup.shards // max(setup.pp_size, 1), 1) if setup.strategy == "fsdp" else 1


def _fsdp_dimension(setup: Setup) -> str:
    if not setup.mesh:
        return "dp"
    shard = _fsdp_group(setup) // max(setup.cp_size, 1)
    if setup.cp_size > 1:
        return "dp_shard_cp" if shard > 1 else "cp"
    return "dp_shard"


def _dp_dimension(setup: Setup) -> str:
    return "dp_replicate" if setup.mesh else "dp"


def _split(count: float, split: float, tp_size: int) -> float:
    """Elements one tensor-parallel rank holds of ``count``, of which ``split`` are divided over ``tp_size``."""
    return count - split + split / max(tp_size, 1)


def _local_counts(shape: ModelShape, setup: Setup) -> tuple[float, float, float]:
    """(parameters, trainable, decoder-layer parameters) one rank holds before any data-parallel sharding."""
    tp = setup.tp_size
    blocks = shape.blocks_params or shape.num_layers * shape.layer_params
    params = _split(shape.params, shape.tp_params, tp)
    trainable = _split(shape.trainable, shape.tp_trainable, tp)
    layers = _split(blocks, min(shape.tp_layer_params * shape.num_layers, blocks), tp)
    return params, trainable, layers


def _data_parallel(out: _Steps, shape: ModelShape, setup: Setup, runs: int) -> None:
    """Gradient synchronisation and sharded parameters; ``runs``: forward/backward passes per step of each stage
    (the accumulation micro-batches)."""
    params, trainable, layers = _local_counts(shape, setup)
    acc = max(setup.accumulation, 1)
    if setup.strategy == "ddp" and setup.data_parallel > 1:
        out.add(_dp_dimension(setup), "all_reduce", setup.data_parallel, trainable * FLOAT32)
    elif setup.strategy == "fsdp":
        group = _fsdp_group(setup)
        if group > 1:
            dim = _fsdp_dimension(setup)
            gathered = setup.compute_bytes if _low_precision(setup) else FLOAT32
            if setup.pp_size > 1:  # stages keep their parameters gathered over a schedule run, reduce every run
                out.add(dim, "all_gather", group, runs * params * gathered)
                out.add(dim, "reduce_scatter", group, runs * trainable * FLOAT32)
            else:
                backward = layers if setup.reshard_after_forward else 0.0
                out.add(dim, "all_gather", group, acc * (params + backward) * gathered)
                out.add(dim, "reduce_scatter", group, trainable * FLOAT32)
            if setup.replicate > 1:
                reductions = runs if setup.pp_size > 1 else 1
                out.add("dp_replicate", "all_reduce", setup.replicate, reductions * trainable / group * FLOAT32)
    elif setup.strategy == "deepspeed" and setup.world_size > 1:
        world, nbytes = setup.world_size, setup.compute_bytes
        if setup.zero_stage >= 3:
            out.add("dp", "all_gather", world, acc * (params + _zero3_regathered(shape)) * nbytes)
            out.add("dp", "reduce_scatter", world, acc * trainable * nbytes)
        else:
            reductions = acc if setup.zero_stage == 2 else 1
            out.add("dp", "all_reduce", world, reductions * trainable * nbytes)
            if setup.zero_stage >= 1:
                out.add("dp", "all_gather", world, trainable * nbytes)


def _zero3_regathered(shape: ModelShape) -> float:
    """Parameters ZeRO-3 gathers again in backward: those of layers whose forward and backward are further apart
    (the parameters gathered in between) than the reuse distance."""
    outer = shape.outer_params
    layers = shape.num_layers
    return sum(
        shape.layer_params
        for i in range(layers)
        if 2 * (layers - 1 - i) * shape.layer_params + outer > ZERO3_REUSE_DISTANCE
    )


def _tensor_parallel(out: _Steps, shape: ModelShape, setup: Setup, rows: int, first: bool, last: bool) -> None:
    """Activation all-reduces per step of ``rows`` sequences per micro-batch over this rank's layers; ``first`` /
    ``last``: the rank holds the embeddings / the head."""
    tp = setup.tp_size
    if tp <= 1:
        return
    acc = max(setup.accumulation, 1)
    tokens = rows * setup.local_seq_len
    low, mixed = _low_precision(setup), setup.strategy == "fsdp" and _fsdp_group(setup) > 1
    forward = setup.compute_bytes if low else FLOAT32
    residual = setup.compute_bytes if low and mixed else FLOAT32  # autocast alone keeps the residual stream fp32
    hidden = tokens * shape.hidden
    colwise = COLWISE_PER_LAYER.get(shape.model_type, DEFAULT_COLWISE)
    rowwise = ROWWISE_PER_LAYER * (2 if setup.checkpointing else 1)
    per_layer = rowwise * hidden * forward + colwise * hidden * residual
    total = shape.num_layers * per_layer
    if shape.causal_lm and first:
        total += hidden * residual  # the vocabulary-split embedding's partial outputs summed
    if shape.causal_lm and last:
        total += hidden * residual  # lm_head's input gradient
        out.add("tp", "all_gather", tp, acc * tokens * shape.vocab * forward)
    out.add("tp", "all_reduce", tp, acc * total)


def _context_parallel(out: _Steps, shape: ModelShape, setup: Setup, rows: int) -> None:
    cp = setup.cp_size
    if cp <= 1:
        return
    acc = max(setup.accumulation, 1)
    length = setup.padded_seq_len
    kv = shape.kv_heads / max(setup.tp_size, 1)
    heads = shape.heads / max(setup.tp_size, 1)
    nbytes = setup.compute_bytes if _low_precision(setup) else FLOAT32
    forwards = 2 if setup.checkpointing else 1  # checkpointing recomputes each layer's forward in backward
    if setup.cp_backend == "torch":  # ring attention gathers repeated heads; not measured on this machine
        gathered = 2 * rows * heads * length * shape.head_dim * nbytes * shape.num_layers
        out.add("cp", "all_gather", cp, acc * (forwards + 1) * gathered)
        out.add("cp", "reduce_scatter", cp, acc * gathered)
        return
    gathered = 2 * rows * kv * length * shape.head_dim * nbytes * shape.num_layers  # keys and values, every layer
    masks = rows * length * (POSITION_BYTES + 1)  # positions and the padding mask, once per forward
    out.add("cp", "all_gather", cp, acc * (forwards * gathered + masks))
    out.add("cp", "all_reduce", cp, acc * gathered)


def _pipeline_sends(setup: Setup, pp_rank: int, rows: int) -> float:
    """Bytes ``pp_rank`` sends per micro-batch: each of its stages' outputs to the next stage and input gradients to
    the previous one, when that stage lives on another rank, for every pipeline microbatch."""
    from trainer_ext.distributed.pipeline.schedules import owner_of_stage, stage_ids, stages_per_rank
    from trainer_ext.estimate.pipeline import microbatches

    name, size = setup.pp_schedule, setup.pp_size
    stages = size * stages_per_rank(name)
    sends = 0
    for stage in stage_ids(name, pp_rank, size):
        if stage < stages - 1 and owner_of_stage(name, stage + 1, size) != pp_rank:
            sends += 1
        if stage > 0 and owner_of_stage(name, stage - 1, size) != pp_rank:
            sends += 1
    count = microbatches(setup)
    per_microbatch = -(-rows // count) * setup.local_seq_len
    return sends * count * per_microbatch


def step_traffic(shape: ModelShape, setup: Setup) -> list[Traffic]:
    """The collectives the busiest rank runs in one optimizer step (every accumulation micro-batch), per mesh
    dimension and collective; see the module docstring for the model."""
    if setup.pp_size <= 1:
        out = _Steps()
        _data_parallel(out, shape, setup, max(setup.accumulation, 1))
        rows = setup.micro_batch * setup.sequences  # a DPO pair is two sequences
        _tensor_parallel(out, shape, setup, rows, True, True)
        _context_parallel(out, shape, setup, rows)
        return sorted(out.traffic(), key=_order)
    from trainer_ext.estimate.pipeline import microbatches, rank_parts

    count = microbatches(setup)
    rows = -(-setup.micro_batch // count) * count  # the runtime pads the batch to whole microbatches
    parts, _, _, _ = rank_parts(shape, setup, setup.micro_batch)
    candidates = []
    for pp_rank, part in enumerate(parts):
        part = replace(part, causal_lm=shape.causal_lm)
        out = _Steps()
        _data_parallel(out, part, setup, max(setup.accumulation, 1))
        holds_first = pp_rank == 0  # stage 0 is on rank 0 in every schedule
        holds_last = part.vocab > 0
        _tensor_parallel(out, replace(part, vocab=shape.vocab), setup, rows, holds_first, holds_last)
        _context_parallel(out, part, setup, rows)
        elements = _pipeline_sends(setup, pp_rank, rows) * shape.hidden
        out.add("pp", "send_recv", setup.pp_size, max(setup.accumulation, 1) * elements * FLOAT32)
        traffic = out.traffic()
        candidates.append((total_wire_bytes(traffic), sorted(traffic, key=_order)))
    return max(candidates, key=lambda c: c[0])[1]


def _order(item: Traffic) -> tuple[int, int]:
    dims = ("dp", "dp_replicate", "dp_shard", "dp_shard_cp", "pp", "cp", "tp")
    return (dims.index(item.dimension) if item.dimension in dims else len(dims), COLLECTIVES.index(item.collective))


# -- naming the groups a run used -------------------------------------------------------------------------------------
def mesh_dims(setup: Setup) -> list[tuple[str, int]]:
    """The job's mesh as (name, size) in the engine's order (``Setup.mesh``); a plain data-parallel job's one ``dp``
    dimension over every rank."""
    if not setup.mesh:
        return [("dp", setup.world_size)] if setup.world_size > 1 else []
    dims = []
    for part in setup.mesh.split(" x "):
        name, size = part.rsplit(" ", 1)
        dims.append((name, int(size)))
    return dims


def dimension_groups(setup: Setup) -> dict[tuple[int, ...], str]:
    """Each process group of the job's mesh (its sorted global ranks, laid out row-major as ``init_device_mesh``
    does) named by its dimension; a group two names share keeps the plain dimension's name, the flattened views
    (``dp_shard_cp``, ``dp``, ``dp_cp``) name the rest."""
    dims = mesh_dims(setup)
    names = [name for name, _ in dims]
    sizes = [size for _, size in dims]
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]

    def groups(axes: list[int]) -> Iterable[tuple[int, ...]]:
        others = [i for i in range(len(sizes)) if i not in axes]
        for fixed in itertools.product(*(range(sizes[i]) for i in others)):
            base = sum(c * strides[i] for c, i in zip(fixed, others, strict=True))
            moving = itertools.product(*(range(sizes[i]) for i in axes))
            yield tuple(
                sorted(base + sum(c * strides[i] for c, i in zip(coords, axes, strict=True)) for coords in moving)
            )

    out: dict[tuple[int, ...], str] = {}
    for axis, name in enumerate(names):
        for group in groups([axis]):
            out.setdefault(group, name)
    for view, joined in FLATTENED:
        axes = [names.index(name) for name in joined if name in names]
        if len(axes) > 1:
            for group in groups(axes):
                out.setdefault(group, view)
    return out
