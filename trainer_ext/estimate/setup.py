"""What the job does with the model: strategy, sharding and offload, precision, batch and sequence, optimizer.

Read from the values of ``trainer-ext train``'s flags (:func:`setup_from_values`) without building any backend, so
an fp16 or 8-GPU ZeRO-3 job is estimated on a CPU machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainer_ext.errors import ConfigError

STRATEGIES = ("single", "ddp", "fsdp", "deepspeed")
# bytes of optimizer state per trainable parameter (fp32 states); adafactor is factored (see optimizer_state)
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "adafactor": 4, "sgd": 4, "lion": 4, "8bit": 2, "rmsprop": 4}


def _optim_args(text: str | None) -> dict[str, str]:
    """transformers' ``--optim_args`` "key=value,key=value" string as a dict."""
    pairs = [item.split("=", 1) for item in str(text or "").replace(" ", "").split(",") if "=" in item]
    return {key: value for key, value in pairs}


def optimizer_state_bytes(optim: str, optim_args: str | None = None) -> int:
    """State bytes per parameter for a transformers ``--optim`` name (AdamW: two fp32 moments = 8).

    SGD keeps a momentum buffer only when ``--optim_args momentum=...`` is non-zero (transformers' default: none).
    Adafactor's value is per *factored* element (:func:`optimizer_state`), not per parameter."""
    name = str(optim).lower()
    if "8bit" in name:
        return OPTIMIZER_STATE_BYTES["8bit"]
    if name == "sgd":
        try:
            momentum = float(_optim_args(optim_args).get("momentum", 0) or 0)
        except ValueError:
            momentum = 0.0
        return 4 if momentum else 0
    for key, value in OPTIMIZER_STATE_BYTES.items():
        if key in name:
            return value
    return 8


def is_factored(optim: str) -> bool:
    """Adafactor (transformers' and torch's): a row and a column second moment per matrix instead of one per entry."""
    return "adafactor" in str(optim).lower()


@dataclass(frozen=True)
class Setup:
    """The memory-relevant choices of one job, per rank."""

    strategy: str = "single"
    world_size: int = 1
    precision: str = "no"  # no | bf16 | fp16
    zero_stage: int = 0  # DeepSpeed only
    sub_group_size: int = 1_000_000_000  # DeepSpeed ZeRO-3: the most elements of a partition it steps at once
    offload_optimizer: bool = False  # ZeRO offload_optimizer / FSDP2 cpu_offload
    offload_params: bool = False  # ZeRO-3 offload_param / FSDP2 cpu_offload
    reshard_after_forward: bool = True  # FSDP2
    micro_batch: int = 8
    seq_len: int = 128
    accumulation: int = 1
    checkpointing: bool = False
    optimizer_bytes: int = 8
    optimizer_factored: bool = False  # Adafactor: state per factored element (ModelShape.factored_trainable)
    replicate: int = 1  # FSDP hybrid sharding: replicas, each sharding over world_size // (replicate * tp_size)
    tp_size: int = 1  # tensor parallelism: ranks that split each layer and see the same batch
    cp_size: int = 1  # context parallelism: ranks that split each sequence and see the same batch
    cp_backend: str = "all_gather"  # the context-parallel attention: all_gather (ours) or torch (ring attention)
    device_type: str = "cpu"  # where the job runs: all_gather keeps grouped key/value heads on CPU, repeated on CUDA
    pp_size: int = (
        1  # pipeline parallelism: ranks holding consecutive stages, seeing the same batch (estimate.pipeline)
    )
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0  # microbatches per schedule run; 0: the schedule's default (one per stage)
    sequences: int = 1  # sequences per example of a micro-batch: 2 for DPO's pairs (chosen and rejected)
    reference_forward: bool = False  # DPO: the reference's log-probabilities, a forward under no_grad each micro-batch

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"unknown strategy {self.strategy!r}; one of {', '.join(STRATEGIES)}")
        if self.world_size < 1:
            raise ConfigError(f"--num_processes must be at least 1, got {self.world_size}")
        if self.strategy == "single" and self.data_parallel > 1:
            object.__setattr__(self, "strategy", "ddp")

    @property
    def data_parallel(self) -> int:
        """Ranks that see different batches: the world over the tensor-, context- and pipeline-parallel ranks."""
        return max(self.world_size // max(self.tp_size * self.cp_size * self.pp_size, 1), 1)

    @property
    def padded_seq_len(self) -> int:
        """The sequence length the ranks split: under context parallelism padded to a multiple of ``2 × cp_size``."""
        if self.cp_size <= 1:
            return self.seq_len
        return -(-self.seq_len // (2 * self.cp_size)) * 2 * self.cp_size

    @property
    def local_seq_len(self) -> int:
        """Positions of each sequence one rank holds: all of them, or under context parallelism its 2 of the
        ``2 × cp_size`` chunks."""
        return self.padded_seq_len // max(self.cp_size, 1)

    @property
    def mesh(self) -> str:
        """The mesh as ``dp_replicate 2 x dp_shard 2 x pp 2`` or ``... x cp 2 x tp 2`` (dimensions above 1); ''
        without tensor, context or pipeline parallelism or a replicated FSDP."""
        split = self.tp_size > 1 or self.cp_size > 1 or self.pp_size > 1
        if not split and not (self.strategy == "fsdp" and self.replicate > 1):
            return ""
        if self.strategy == "fsdp":  # FSDP2 shards over dp_shard x cp: the shards hold cp_size of each dp_shard
            shard = self.shards // max(self.cp_size * self.pp_size, 1)
            dims = (("dp_replicate", self.replicate), ("dp_shard", shard))
        else:
            dims = (("dp_replicate", self.data_parallel),)
        dims += (("pp", self.pp_size), ("cp", self.cp_size), ("tp", self.tp_size))
        return " x ".join(f"{name} {size}" for name, size in dims if size > 1)

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and of gathered/cast weights: 2 under bf16/fp16, else 4."""
        return 2 if self.precision in ("bf16", "fp16") else 4

    @property
    def shards(self) -> int:
        if self.strategy == "fsdp":
            return max(self.world_size // (max(self.replicate, 1) * max(self.tp_size, 1)), 1)
        return self.world_size if self.strategy == "deepspeed" else 1

    def replace(self, **changes: Any) -> Setup:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line: strategy and options, world size, precision, batch."""
        if self.strategy == "fsdp":
            name = "FSDP2 " + ("full_shard" if self.reshard_after_forward else "shard_grad_op")
            name += f" (hybrid: {self.replicate} replicas of {self.shards} shards)" if self.replicate > 1 else ""
            name += " + cpu_offload" if self.offload_params else ""
        elif self.strategy == "deepspeed":
            name = f"DeepSpeed ZeRO-{self.zero_stage}"
            offloads = [w for w, on in (("optimizer", self.offload_optimizer), ("param", self.offload_params)) if on]
            name += f" (offload {', '.join(offloads)})" if offloads else ""
        else:
            name = self.strategy.upper() if self.strategy == "ddp" else "single process"
        if self.tp_size > 1 or self.cp_size > 1 or self.pp_size > 1:
            parts = [f"pipeline parallel {self.pp_size} ({self.pp_schedule})"] if self.pp_size > 1 else []
            parts += [f"tensor parallel {self.tp_size}"] if self.tp_size > 1 else []
            parts += [f"context parallel {self.cp_size} ({self.cp_backend})"] if self.cp_size > 1 else []
            parts += [name] if self.data_parallel > 1 or self.shards > 1 else []
            name = " x ".join(parts) + f" (mesh {self.mesh})"
        precision = {"no": "fp32"}.get(self.precision, self.precision)
        ckpt = ", activation checkpointing" if self.checkpointing else ""
        batch = f"{self.micro_batch}"
        if self.sequences > 1:
            batch += f" pair{'s' * (self.micro_batch > 1)} ({self.micro_batch * self.sequences} sequences)"
        return (
            f"{name} on {self.world_size} process{'es' if self.world_size > 1 else ''}, {precision}, micro-batch "
            f"{batch} x {self.seq_len} tokens, accumulation {self.accumulation}{ckpt}"
        )


def _deepspeed_settings(source: Any) -> dict[str, Any]:
    from trainer_ext.distributed.strategies.deepspeed.config import get_value, load_deepspeed_config, zero_stage

    config = load_deepspeed_config(source)

    def offloaded(key: str) -> bool:
        return str(get_value(config, f"zero_optimization.{key}.device", "none")).lower() in ("cpu", "nvme")

    precision = None
    for name in ("bf16", "fp16"):
        if get_value(config, f"{name}.enabled", False) is True:
            precision = name
    sub_group_size = get_value(config, "zero_optimization.sub_group_size", None)
    return dict(
        zero_stage=zero_stage(config),
        sub_group_size=int(sub_group_size) if isinstance(sub_group_size, (int, float)) else Setup.sub_group_size,
        offload_optimizer=offloaded("offload_optimizer"),
        offload_params=offloaded("offload_param"),
        precision=precision,
    )


def fsdp_options(settings: Any, world_size: int) -> dict[str, Any]:
    """Setup fields of FSDP settings (an :class:`FSDPSettings`): resharding, offload, hybrid replicas.

    Hybrid sharding without ``replicate_size`` replicates over machines; the estimate assumes one machine."""
    replicate = 1
    if settings.hybrid_shard and settings.replicate_size:
        replicate = int(settings.replicate_size)
        if replicate < 1 or world_size % replicate:
            raise ConfigError(
                f"fsdp_config: replicate_size {replicate} does not divide the {world_size} processes; choose a "
                "divisor (hybrid sharding = replicate_size groups of world/replicate_size shards)"
            )
    return dict(
        reshard_after_forward=settings.reshard_after_forward,
        offload_params=settings.cpu_offload,
        offload_optimizer=settings.cpu_offload,
        replicate=replicate,
    )


def estimated_backend(requested: str | None, device_type: str = "cpu") -> str:
    """The context-parallel attention ``device_type`` runs for ``requested``: ``auto`` is torch's ring attention on
    CUDA, all_gather elsewhere."""
    requested = requested or "auto"
    if requested != "auto":
        return requested
    return "torch" if device_type == "cuda" else "all_gather"


def setup_from_values(
    values: dict[str, Any], world_size: int, seq_len: int, fsdp_settings: Any = None, device_type: str | None = None
) -> Setup:
    """The Setup of a ``trainer-ext train`` job from its flag values (after defaults were filled in).

    ``fsdp_settings``: the job's :class:`FSDPSettings` when already read (``train``'s start-up); else they are read
    from the ``fsdp``/``fsdp_config`` values. ``device_type``: where the job runs (default cpu), which decides the
    context-parallel attention ``auto`` stands for."""
    from trainer_ext.distributed.strategies.fsdp.config import fsdp_requested, parse_fsdp

    precision = "bf16" if values.get("bf16") else "fp16" if values.get("fp16") else "no"
    checkpointing = bool(values.get("activation_checkpointing") or values.get("gradient_checkpointing"))
    options: dict[str, Any] = {}
    strategy = "ddp" if world_size > 1 else "single"
    if values.get("deepspeed"):
        strategy = "deepspeed"
        ds = _deepspeed_settings(values["deepspeed"])
        precision = ds.pop("precision") or precision
        options.update(ds)
    elif fsdp_settings is not None or fsdp_requested(values.get("fsdp")):
        strategy = "fsdp"
        settings = fsdp_settings or parse_fsdp(values.get("fsdp"), values.get("fsdp_config"))
        options.update(fsdp_options(settings, world_size))
        checkpointing = checkpointing or settings.activation_checkpointing
    tp_size, cp_size = int(values.get("tp_size") or 1), int(values.get("cp_size") or 1)
    pp_size = int(values.get("pp_size") or 1)
    dp_shard, dp_replicate = int(values.get("dp_shard_size") or 1), int(values.get("dp_replicate_size") or 1)
    if (dp_shard > 1 or cp_size > 1) and strategy != "fsdp":  # FSDP2 runs over a mesh's dp_shard x cp
        strategy = "fsdp"
        settings = parse_fsdp("full_shard", values.get("fsdp_config"))
        options.update(fsdp_options(settings, world_size))
        checkpointing = checkpointing or settings.activation_checkpointing
    if strategy == "fsdp" and (dp_shard > 1 or tp_size > 1 or cp_size > 1 or pp_size > 1):
        options["replicate"] = dp_replicate
    if pp_size > 1:
        schedule = values.get("pp_schedule") or "1f1b"
        options.update(pp_size=pp_size, pp_schedule=schedule, pp_microbatches=int(values.get("pp_microbatches") or 0))
    if cp_size > 1:
        device = device_type or "cpu"
        options.update(
            cp_size=cp_size, cp_backend=estimated_backend(values.get("cp_backend"), device), device_type=device
        )
    optim = values.get("optim") or "adamw_torch"
    if values.get("task") == "dpo":  # chosen and rejected of every pair through the policy as one batch
        reference = not values.get("reference_free") and values.get("loss_type") != "simpo"
        options.update(sequences=2, reference_forward=reference)
    return Setup(
        strategy=strategy,
        world_size=world_size,
        precision=precision,
        micro_batch=int(values.get("per_device_train_batch_size") or 8),
        seq_len=seq_len,
        accumulation=int(values.get("gradient_accumulation_steps") or 1),
        checkpointing=checkpointing,
        optimizer_bytes=optimizer_state_bytes(optim, values.get("optim_args")),
        optimizer_factored=is_factored(optim),
        tp_size=tp_size,
        **options,
    )
