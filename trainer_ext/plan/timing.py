"""The step-time model that ranks layouts: compute spread over the ranks, the pipeline's bubble, and communication.

compute: a token costs ``2·P`` FLOPs forward plus ``2·L·s·h`` for causal attention, backward twice the forward for
the inputs' gradients plus ``2·T`` for the trainable weights' (``P`` parameters, ``T`` trainable, ``L`` layers, ``s``
the sequence, ``h`` the hidden size), activation checkpointing one more forward, DPO's reference model one more
forward (a pair is two sequences). A data-parallel rank's tokens are
split over its tensor-, context- and pipeline-parallel ranks; under a pipeline each rank also idles the bubble.
communication: the bytes :func:`~trainer_ext.plan.comms.step_traffic` moves per collective, sent as rings
(:func:`~trainer_ext.plan.comms.wire_bytes`) at the speed of the link the dimension's group spans. Tensor, context
and pipeline traffic sits on the critical path; data-parallel traffic (gradient reduction, FSDP/ZeRO-3 gathers)
overlaps with compute and counts only where it is longer (the hidden part at 10 %: its kernels share the device). CPU offload adds the optimizer step on the host and the
transfers over PCIe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer_ext.estimate.setup import Setup
from trainer_ext.estimate.shape import ModelShape
from trainer_ext.plan.cluster import INTERCONNECTS, Cluster
from trainer_ext.plan.layouts import Layout

MODEL_PARALLEL = ("tp", "cp", "pp")
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
HIDDEN_COST = 0.1  # the share of hidden communication's time a step still pays
HOST_BYTES_PER_SECOND = 10e9  # a host's memory bandwidth for the offloaded optimizer step, per rank


@dataclass(frozen=True)
class Timing:
    """Seconds per optimizer step: compute (bubble included), exposed communication, offload, and the traffic by
    link (bytes each rank sends per step)."""

    compute: float
    communication: float
    exposed: float
    offload: float
    bubble: float = 0.0
    hidden: float = 0.0  # data-parallel communication overlapped with compute
    sent: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.compute + self.exposed + self.offload

    @property
    def score(self) -> float:
        """What layouts are ranked by: the step time, hidden communication counted at ``HIDDEN_COST`` (its kernels
        share the device with the compute they hide behind)."""
        return self.total + HIDDEN_COST * self.hidden


def flops_per_token(shape: ModelShape, setup: Setup) -> float:
    """Training FLOPs of one token (forward, backward, and a second forward under activation checkpointing)."""
    attention = 2.0 * shape.num_layers * setup.seq_len * shape.hidden if shape.causal_lm else 0.0
    forward = 2.0 * shape.params + attention
    backward = 2.0 * shape.params + 2.0 * attention + 2.0 * shape.trainable
    reference = forward if setup.reference_forward else 0.0  # DPO's reference log-probabilities: a forward more
    return forward * (2 if setup.checkpointing else 1) + backward + reference


def group_span(layout: Layout, dimension: str, group_size: int) -> tuple[int, int]:
    """(stride, size) of a group of ``dimension`` whose ranks span as far as its parts: a flattened dimension
    (``dp`` = dp_replicate × dp_shard, ``dp_shard_cp``) spans the outermost of them; DDP's and ZeRO's ``dp`` the
    world."""
    dims = {name: (stride, size) for name, size, stride in layout.dimensions()}
    if dimension in dims:
        return dims[dimension]
    parts = FLATTENED.get(dimension, ())
    spans = [dims[name][0] * dims[name][1] for name in parts if name in dims]
    if not spans:
        return 1, group_size
    span = max(spans)
    return max(span // max(group_size, 1), 1), group_size


def step_timing(shape: ModelShape, setup: Setup, layout: Layout, cluster: Cluster) -> Timing:
    """The step time of ``layout`` (its Setup ``setup``) on ``cluster``."""
    from trainer_ext.plan.comms import step_traffic, wire_bytes

    tokens = setup.micro_batch * setup.sequences * setup.accumulation * setup.seq_len  # a data-parallel rank's
    split = layout.tp * layout.cp * layout.pp
    compute = flops_per_token(shape, setup) * tokens / split / cluster.flops(setup.precision)
    bubble = 0.0
    if layout.pp > 1:
        from trainer_ext.estimate.pipeline import bubble as pipeline_bubble

        bubble = pipeline_bubble(setup)
        compute /= max(1.0 - bubble, 1e-3)
    critical = overlapped = 0.0
    sent: dict[str, float] = {}
    for traffic in step_traffic(shape, setup):
        link = cluster.link(*group_span(layout, traffic.dimension, traffic.group_size))
        wire = wire_bytes(traffic)
        sent[link] = sent.get(link, 0.0) + wire
        seconds = wire / INTERCONNECTS[link]
        if traffic.dimension in MODEL_PARALLEL:
            critical += seconds
        else:
            overlapped += seconds
    offload = 0.0
    if setup.offload_optimizer:
        local = shape.trainable / max(setup.shards, 1)
        host = setup.optimizer_bytes + 8  # states, fp32 master weights and gradients read and written on the host
        offload = local * host / HOST_BYTES_PER_SECOND + 2 * 4 * local / INTERCONNECTS["pcie"]
    return Timing(
        compute=compute,
        communication=critical + overlapped,
        exposed=critical + max(overlapped - compute, 0.0),
        hidden=min(overlapped, compute),
        offload=offload,
        bubble=bubble,
        sent=sent,
    )
