"""The layouts a job could run with on a cluster: the families, the mesh sizes each allows, and their train flags.

A layout is a data-parallel family (DDP, FSDP2, HSDP, DeepSpeed ZeRO-1/2/3, with or without CPU offload) over the
ranks the model-parallel sizes leave (tensor ``tp``, context ``cp``, pipeline ``pp``), activation checkpointing on or
off, and a micro-batch with its accumulation. Only layouts the engine runs are listed: tensor, context and pipeline
parallelism run on FSDP2 (never DeepSpeed), tensor parallelism stays within a machine, pipeline and context
parallelism not together, and each size passes the model checks ``train`` applies (heads and key/value heads
divisible by ``tp``, a model the pipeline can split into ``pp`` stages, a causal LM for ``cp``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from trainer_ext.errors import ConfigError
from trainer_ext.plan.cluster import Cluster

FAMILIES = ("single", "ddp", "fsdp", "hsdp", "zero1", "zero2", "zero3")
# the train flags a layout sets: given by the user, they fix that part of the layout
LAYOUT_FLAGS = (
    "fsdp",
    "deepspeed",
    "dp_replicate_size",
    "dp_shard_size",
    "tp_size",
    "cp_size",
    "pp_size",
    "pp_schedule",
    "pp_microbatches",
)
CHECKPOINTING_FLAGS = ("gradient_checkpointing", "activation_checkpointing")
# every train flag a plan's layout sets: the layout's own, the batch split and activation checkpointing
PLANNED_FLAGS = (*LAYOUT_FLAGS, "per_device_train_batch_size", "gradient_accumulation_steps", *CHECKPOINTING_FLAGS)
DEEPSPEED_FILES = {
    (1, False): "zero1.json",
    (2, False): "zero2.json",
    (3, False): "zero3.json",
    (2, True): "zero2_offload.json",
    (3, True): "zero3_offload.json",
}


@dataclass(frozen=True)
class Layout:
    """One way to run the job: its family, mesh sizes, offload, checkpointing and batch per rank."""

    family: str
    dp_replicate: int = 1  # DDP / ZeRO: the data-parallel ranks; HSDP: the replicas
    dp_shard: int = 1  # FSDP2 / HSDP: the ranks each parameter is sharded over
    tp: int = 1
    cp: int = 1
    pp: int = 1
    offload: bool = False
    reshard: bool = True  # FSDP2: full_shard (False: shard_grad_op, parameters kept gathered between passes)
    checkpointing: bool = False
    micro_batch: int = 1
    accumulation: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.data_parallel * self.tp * self.cp * self.pp

    @property
    def mesh(self) -> bool:
        """Whether the layout is a device mesh (tensor, context or pipeline sizes, or HSDP)."""
        return self.tp > 1 or self.cp > 1 or self.pp > 1 or self.family == "hsdp"

    @property
    def zero_stage(self) -> int:
        return int(self.family[-1]) if self.family.startswith("zero") else 0

    def replace(self, **changes: Any) -> Layout:
        return dataclasses.replace(self, **changes)

    def dimensions(self) -> list[tuple[str, int, int]]:
        """(dimension, size, stride) of each process group above one rank, in the engine's mesh order
        (dp_replicate, dp_shard, pp, cp, tp; tp innermost); DDP's and ZeRO's one group is ``dp``."""
        if self.family in ("single", "ddp") or self.family.startswith("zero"):
            return [("dp", self.dp_replicate, 1)] if self.dp_replicate > 1 else []
        found = [("tp", self.tp, 1), ("cp", self.cp, self.tp), ("pp", self.pp, self.tp * self.cp)]
        inner = self.tp * self.cp * self.pp
        found += [("dp_shard", self.dp_shard, inner), ("dp_replicate", self.dp_replicate, inner * self.dp_shard)]
        return [(name, size, stride) for name, size, stride in found if size > 1]

    def name(self) -> str:
        """E.g. ``FSDP2 dp_shard 8 x tp 2``, ``DeepSpeed ZeRO-3 + offload over 4``, ``DDP over 8``."""
        if self.family == "single":
            base = "one process"
        elif self.family == "ddp":
            base = f"DDP over {self.dp_replicate}"
        elif self.family.startswith("zero"):
            base = f"DeepSpeed ZeRO-{self.zero_stage}{' + offload' if self.offload else ''} over {self.dp_replicate}"
        else:
            dims = [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)]
            dims += [("pp", self.pp), ("cp", self.cp), ("tp", self.tp)]
            mesh = " x ".join(f"{name} {size}" for name, size in dims if size > 1)
            kind = "HSDP" if self.family == "hsdp" else "FSDP2" if self.dp_shard > 1 else "mesh"
            kind += "" if self.reshard else " shard_grad_op"
            kind += " + offload" if self.offload else ""
            base = f"{kind} {mesh}".strip() if mesh else f"{kind} over 1"
        if self.pp > 1:
            base += f" ({self.pp_schedule}, {self.pp_microbatches} microbatches)"
        return base + (", activation checkpointing" if self.checkpointing else "")

    def values(self) -> dict[str, Any]:
        """The train flag values of the layout, as ``train`` reads them (the DeepSpeed config as its JSON)."""
        values: dict[str, Any] = {name: None for name in LAYOUT_FLAGS}
        values.update(
            per_device_train_batch_size=self.micro_batch,
            gradient_accumulation_steps=self.accumulation,
            gradient_checkpointing=self.checkpointing,
            activation_checkpointing=None,
        )
        if self.family.startswith("zero"):
            values["deepspeed"] = deepspeed_config(self.zero_stage, self.offload)
        elif self.family in ("fsdp", "hsdp"):
            if self.mesh:
                values.update(
                    dp_replicate_size=self.dp_replicate,
                    dp_shard_size=self.dp_shard,
                    tp_size=self.tp,
                    cp_size=self.cp,
                    pp_size=self.pp,
                )
                if self.pp > 1:
                    values.update(pp_schedule=self.pp_schedule, pp_microbatches=self.pp_microbatches)
            else:
                values["fsdp"] = fsdp_option(self)
        return values

    def flags(self, checkpointing_flag: str = "--gradient_checkpointing") -> list[str]:
        """The train flags that run the layout (added to the job's own)."""
        flags: list[str] = []
        if self.family.startswith("zero"):
            flags += ["--deepspeed", f"configs/deepspeed/{DEEPSPEED_FILES[self.zero_stage, self.offload]}"]
        elif self.family in ("fsdp", "hsdp") and not self.mesh:
            flags += ["--fsdp", fsdp_option(self)]
        elif self.mesh:
            sizes = (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard))
            sizes += (("tp", self.tp), ("cp", self.cp), ("pp", self.pp))
            for name, size in sizes:
                if size > 1:
                    flags += [f"--{name}_size", str(size)]
            if self.pp > 1:
                flags += ["--pp_schedule", self.pp_schedule, "--pp_microbatches", str(self.pp_microbatches)]
        flags += ["--per_device_train_batch_size", str(self.micro_batch)]
        flags += ["--gradient_accumulation_steps", str(self.accumulation)]
        if self.checkpointing:
            flags.append(checkpointing_flag)
        return flags


def fsdp_option(layout: Layout) -> str:
    return ("full_shard" if layout.reshard else "shard_grad_op") + (" offload" if layout.offload else "")


def deepspeed_config(stage: int, offload: bool) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO stage as the shipped ``configs/deepspeed/zero*.json`` set it up."""
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def model_sizes(cluster: Cluster, check: Any, constraints: dict[str, int]) -> Iterator[tuple[int, int, int]]:
    """(tp, cp, pp) sizes the cluster and the model allow: tp divides the devices of one machine, the product
    divides the world, cp and pp not together; ``check(name, size)`` returns None or why the model refuses it."""
    world, machine = cluster.world, cluster.per_machine
    allowed = {name: [s for s in divisors(world) if check(name, s) is None] for name in ("tp", "cp", "pp")}
    for tp in allowed["tp"]:
        if machine % tp or (constraints.get("tp_size") or tp) != tp:
            continue
        for cp in allowed["cp"]:
            for pp in allowed["pp"]:
                if world % (tp * cp * pp) or (cp > 1 and pp > 1):
                    continue
                if (constraints.get("cp_size") or cp) != cp or (constraints.get("pp_size") or pp) != pp:
                    continue
                yield tp, cp, pp


def families(world: int, tp: int, cp: int, pp: int, fixed: dict[str, Any]) -> Iterator[Layout]:
    """The data-parallel layouts over what (tp, cp, pp) leave of ``world``, with offload variants, before batch
    and checkpointing are chosen; ``fixed`` holds the user's own layout flags."""
    dp = world // (tp * cp * pp)
    model_parallel = tp * cp * pp > 1
    for layout in _families(dp, model_parallel):
        layout = layout.replace(tp=tp, cp=cp, pp=pp)
        if _matches(layout, fixed):
            yield layout


def _families(dp: int, model_parallel: bool) -> Iterator[Layout]:
    if dp == 1:
        yield Layout("fsdp") if model_parallel else Layout("single")
        if not model_parallel:
            yield Layout("fsdp", offload=True)
        return
    yield Layout("fsdp", dp_shard=dp)
    for replicas in divisors(dp)[1:-1]:
        yield Layout("hsdp", dp_replicate=replicas, dp_shard=dp // replicas)
    if model_parallel:
        return
    yield Layout("ddp", dp_replicate=dp)
    yield Layout("fsdp", dp_shard=dp, reshard=False)
    yield Layout("fsdp", dp_shard=dp, offload=True)
    for stage in (1, 2, 3):
        yield Layout(f"zero{stage}", dp_replicate=dp)
    for stage in (2, 3):
        yield Layout(f"zero{stage}", dp_replicate=dp, offload=True)


def _matches(layout: Layout, fixed: dict[str, Any]) -> bool:
    """Whether the layout keeps what the user's own flags fixed: --deepspeed (its stage and offload), --fsdp,
    the dp sizes."""
    if fixed.get("deepspeed") is not None:
        stage, offload = fixed["deepspeed"]
        return layout.family == f"zero{stage}" and layout.offload == offload
    if fixed.get("fsdp") is not None:
        reshard, offload = fixed["fsdp"]
        if layout.family not in ("fsdp", "hsdp") or layout.offload != offload or layout.reshard != reshard:
            return False
    for name in ("dp_replicate", "dp_shard"):
        size = fixed.get(f"{name}_size")
        if size and getattr(layout, name) != size:
            return False
    return True


def fixed_by_flags(values: dict[str, Any]) -> dict[str, Any]:
    """What the user's own layout flags fix: sizes, --fsdp (resharding, offload), --deepspeed (stage, offload)."""
    from trainer_ext.distributed.strategies.fsdp.config import fsdp_requested, parse_fsdp

    fixed: dict[str, Any] = {}
    for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "pp_size"):
        size = values.get(name)
        if size:
            fixed[name] = int(size)
    if values.get("deepspeed"):
        from trainer_ext.estimate.setup import _deepspeed_settings

        settings = _deepspeed_settings(values["deepspeed"])
        if settings["zero_stage"] not in (1, 2, 3):
            raise ConfigError(
                f"--deepspeed {values['deepspeed']}: ZeRO stage {settings['zero_stage']} is not planned; use a "
                "stage 1-3 config or leave --deepspeed out to let the plan choose"
            )
        fixed["deepspeed"] = (settings["zero_stage"], settings["offload_optimizer"])
    elif fsdp_requested(values.get("fsdp")):
        settings = parse_fsdp(values.get("fsdp"), values.get("fsdp_config"))
        fixed["fsdp"] = (settings.reshard_after_forward, settings.cpu_offload)
    return fixed


def drop_flags(argv: Sequence[str], dests: set[str]) -> list[str]:
    """``argv`` without the flags (and their values) whose destination is in ``dests``, read as train reads them."""
    from trainer_ext.job.flag_spec import _is_value, load_spec
    from trainer_ext.job.flags import build_parser

    by_option = {}
    for flag in load_spec(build_parser):
        for option in (*flag.options, *flag.negative):
            by_option[option] = flag
    kept: list[str] = []
    words, i = list(argv), 0
    while i < len(words):
        word = words[i]
        option, inline = word.split("=", 1) if "=" in word else (word, None)
        flag = by_option.get(option)
        span = [word]
        i += 1
        if flag is not None and inline is None and flag.kind != "switch" and option not in flag.negative:
            taken = 0
            while i < len(words) and _is_value(words[i]) and (flag.nargs in ("+", "*") or not taken):
                span.append(words[i])
                taken += 1
                i += 1
        if flag is None or flag.dest not in dests:
            kept += span
    return kept
