"""Per-rank memory for one job: weights, gradients, optimizer states, activations, per strategy.

``total`` is what a rank holds at the step (tensors plus bytes saved for backward): the number ``--measure``
checks. A DPO job's frozen reference model is a part of its own (``reference``): whole on every rank in its own dtype
(``ModelShape.reference_bytes``; never sharded, offloaded or cast), and a micro-batch of ``b`` pairs runs ``2b``
sequences through the policy. ``peak`` adds the short-lived buffers a device must also fit (gathered FSDP/ZeRO-3 units, autocast weight
copies, DDP's gradient buckets, the logits around the loss); the fit search and the start-up warning use it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from trainer_ext.estimate import pipeline
from trainer_ext.estimate.activations import activation_bytes, transient_activation_bytes
from trainer_ext.estimate.setup import Setup
from trainer_ext.estimate.shape import ModelShape

KEYS = ("weights", "gradients", "optimizer", "reference", "activations", "total")


@dataclass(frozen=True)
class Breakdown:
    """Bytes per rank on the device; ``offloaded`` is host memory per rank under CPU offload."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    activations_checkpointed: int
    activations_full: int
    transient: int
    offloaded: int
    reference: int = 0  # DPO's frozen reference model's weights

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference + self.activations

    @property
    def peak(self) -> int:
        return self.total + self.transient

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total, "peak": self.peak}


def _states(shape: ModelShape, setup: Setup) -> tuple[float, float, float, float, float]:
    """(weights, gradients, optimizer, transient weights, offloaded) bytes per rank."""
    tp, w = setup.tp_size, setup.shards
    ob = optimizer_state(shape, setup) / max(shape.trainable, 1)  # bytes per trainable parameter (Adafactor: < 4)
    # what one tensor-parallel rank holds: the plan's split parameters divided by tp_size, the rest whole
    p, t = shape.tp_local(shape.params, shape.tp_params, tp), shape.tp_local(shape.trainable, shape.tp_trainable, tp)
    layer = shape.tp_local(shape.layer_params, shape.tp_layer_params, tp)
    outer = shape.tp_local(shape.outer_params, max(shape.tp_params - shape.num_layers * shape.tp_layer_params, 0), tp)
    cb = setup.compute_bytes
    mixed = setup.precision in ("bf16", "fp16")
    gathered = cb * (outer + 2 * layer)  # root unit + the running and the prefetched layer
    if setup.strategy == "fsdp":
        states = (4 * p / w, 4 * t / w, ob * t / w)
        transient = (gathered if setup.reshard_after_forward else cb * p) + 4 * max(layer, outer)
        if setup.offload_params:
            return 0.0, 0.0, 0.0, transient, sum(states)
        return (*states, transient, 0.0)
    if setup.strategy == "deepspeed":
        md = 2 if mixed else 4  # DeepSpeed keeps the model itself in the training dtype, plus fp32 master partitions
        stage = setup.zero_stage
        model = md * p / w if stage >= 3 else md * p
        # fp32 master weights: stages 1-3 keep a partition of them in every precision, ZeRO-0 a whole copy under
        # bf16/fp16 (its BF16/FP16 optimizer) and none under fp32. ZeRO-3 in fp32 means to step its fp32 partitions
        # in place, but it tests `partition.device == self.device` against a device name (a str), never equal to a
        # torch.device: it clones them (measured on gloo ranks, weights 2 x 4P/W)
        master = 4 * p / w if stage >= 1 else (4 * p if mixed else 0.0)
        if stage == 0:
            grads = md * t
        else:
            # in the step, stages 1-3 hold the rank's reduced gradient partition and the fp32 copy the step
            # flattens it into for the optimizer (stage_1_and_2's step, stage 3's _prepare_fp32_grad_for_sub_group):
            # one parameter group at a time (the decayed group, nearly all of it), at most sub_group_size elements
            # under ZeRO-3. Measured on 2 and 4 gloo ranks inside the step
            grads = md * t / w + 4 * (min(t / w, setup.sub_group_size) if stage >= 3 else t / w)
            if stage <= 2:
                # ZeRO-1/2's buffer holds every parameter that overlaps the rank's partition whole, the ones across
                # its two ends too: about one largest tensor more (ZeRO-3 splits each parameter; tiny-llama, the
                # busiest rank within 4 %, without this 18 % under on 4 ranks)
                grads += md * min(max(shape.vocab, shape.intermediate) * shape.hidden, t - t / w)
            if stage == 1:
                # ZeRO-1 reduces after backward (reduce_gradients, without overlap_comm): whole gradients until then
                grads = max(grads, md * t)
        optim = ob * t / w if stage >= 1 else ob * t
        offloaded = 0.0
        if setup.offload_optimizer:
            offloaded += master + grads + optim
            master = grads = optim = 0.0
        if setup.offload_params and stage >= 3:
            offloaded += model
            model = 0.0
        transient = md * (outer + 2 * layer) if stage >= 3 else 0.0
        return model + master, grads, optim, transient, offloaded
    transient = (cb * p if mixed else 0) + (4 * t if setup.strategy == "ddp" else 0)  # autocast copies, DDP buckets
    return 4 * p, 4 * t, ob * t, transient, 0.0


def optimizer_state(shape: ModelShape, setup: Setup) -> int:
    """Bytes of optimizer state for the whole model (before sharding): ``optimizer_bytes`` per trainable parameter,
    or per factored element under Adafactor (a row and a column second moment per matrix)."""
    elements = (shape.factored_trainable or shape.trainable) if setup.optimizer_factored else shape.trainable
    return setup.optimizer_bytes * elements


def estimate(shape: ModelShape, setup: Setup, batch: int | None = None) -> Breakdown:
    """The per-rank memory of ``setup`` (at micro-batch ``batch``, default the setup's); under pipeline
    parallelism the busiest stage rank's (:mod:`trainer_ext.estimate.pipeline`)."""
    batch = setup.micro_batch if batch is None else batch
    if setup.pp_size > 1:
        return _pipeline_estimate(shape, setup, batch)
    weights, gradients, optimizer, transient, offloaded = _states(shape, setup)
    rows = batch * setup.sequences  # the sequences through the model: a DPO pair's chosen and rejected
    full = activation_bytes(shape, setup, rows, checkpointing=False)
    checkpointed = activation_bytes(shape, setup, rows, checkpointing=True)
    return Breakdown(
        weights=int(weights),
        gradients=int(gradients),
        optimizer=int(optimizer),
        activations=checkpointed if setup.checkpointing else full,
        activations_checkpointed=checkpointed,
        activations_full=full,
        transient=int(transient + transient_activation_bytes(shape, setup, rows, setup.checkpointing)),
        offloaded=int(offloaded),
        reference=shape.reference_bytes,
    )


def _pipeline_estimate(shape: ModelShape, setup: Setup, batch: int) -> Breakdown:
    """The busiest pipeline rank: each rank's part estimated as one stage's job at one microbatch, less the outside
    activations only the last stage saves, times the microbatches that rank keeps in flight
    (:mod:`trainer_ext.estimate.pipeline`)."""
    parts, inner, micro, _ = pipeline.rank_parts(shape, setup, batch)
    best = None
    for rank, part in enumerate(parts):
        one = estimate(part, inner, micro)
        flight = pipeline.in_flight(setup, rank)
        cut = pipeline.outer_elements_not_saved(shape, setup, rank) * micro * inner.local_seq_len * inner.compute_bytes
        names = ("activations", "activations_checkpointed", "activations_full")
        result = replace(one, **{name: int(max(getattr(one, name) - cut, 0)) * flight for name in names})
        if best is None or result.peak > best.peak:
            best = result
    assert best is not None
    return best
