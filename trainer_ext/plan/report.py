"""The plan as text (the top layouts, why each, the command that runs it) and as JSON for tools."""

from __future__ import annotations

import shlex
from typing import Any

from trainer_ext.plan.cluster import Cluster
from trainer_ext.plan.planner import Candidate, Plan
from trainer_ext.values import format_size


def launch_command(candidate: Candidate, plan: Plan) -> str:
    """The exact ``trainer-ext launch`` (or ``train``, on one process) command that runs the candidate."""
    from trainer_ext.estimate.fit import checkpointing_flag

    cluster = plan.cluster
    train = [*_without_layout(plan.train_argv), *candidate.layout.flags(checkpointing_flag())]
    if candidate.layout.world == 1:
        return shlex.join(["trainer-ext", "train", *train])
    launch = ["trainer-ext", "launch"]
    if cluster.num_machines > 1:
        launch += ["--num_machines", str(cluster.num_machines), "--machine_rank", "$MACHINE_RANK"]
        launch += ["--main_process_ip", "$MAIN_IP"]
    launch += ["--num_processes", str(candidate.layout.world)]
    if cluster.device == "cpu":
        launch.append("--cpu")
    text = shlex.join([*launch, "train", *train])
    return text.replace("'$MACHINE_RANK'", "$MACHINE_RANK").replace("'$MAIN_IP'", "$MAIN_IP")


def _without_layout(argv: list[str]) -> list[str]:
    """The job's flags without those the plan sets (sizes, --fsdp, --deepspeed, batch, checkpointing, and
    --parallelism), read as train reads them."""
    from trainer_ext.plan.layouts import PLANNED_FLAGS, drop_flags

    return drop_flags(argv, {*PLANNED_FLAGS, "fsdp_config", "parallelism"})


def reasons(candidate: Candidate, plan: Plan) -> list[str]:
    """Why this layout: its memory against the device, where its time goes, and what each choice buys."""
    layout, memory, timing, cluster = candidate.layout, candidate.memory, candidate.timing, plan.cluster
    shape, found = plan.job.shape, []
    states = memory.weights + memory.gradients + memory.optimizer
    device = f" of {format_size(cluster.device_memory)}" if cluster.device_memory else ""
    share = f" ({memory.peak / cluster.device_memory:.0%})" if cluster.device_memory else ""
    found.append(
        f"memory per rank: peak {format_size(memory.peak)}{device}{share}; states {format_size(states)}, "
        + (f"reference model {format_size(memory.reference)}, " if memory.reference else "")
        + f"activations {format_size(memory.activations)}"
    )
    links = ", ".join(f"{format_size(int(sent))} over {link}" for link, sent in sorted(timing.sent.items()))
    found.append(
        f"step {timing.total:.3g} s: compute {timing.compute:.3g} s, communication {timing.communication:.3g} s "
        f"({timing.exposed:.3g} s not hidden by compute){f'; sends {links}' if links else ''}"
    )
    whole = 16 * shape.params  # weights, gradients and Adam states in fp32, unsharded
    if layout.family == "ddp":
        found.append("the model's states fit whole on each device: DDP moves only one gradient all-reduce per step")
    elif layout.family.startswith("zero") or (layout.family in ("fsdp", "hsdp") and layout.dp_shard > 1):
        found.append(
            f"states sharded over {layout.dp_shard if layout.dp_shard > 1 else layout.dp_replicate} ranks "
            f"(unsharded they would take about {format_size(whole)} per device)"
        )
    if layout.family == "hsdp":
        across = cluster.spans_machines(layout.tp * layout.cp * layout.pp * layout.dp_shard, layout.dp_replicate)
        found.append(
            f"HSDP: {layout.dp_replicate} replicas of {layout.dp_shard} shards; only the shards' gradient "
            f"all-reduce crosses {'machines' if across else 'the replica groups'}"
        )
    if layout.offload:
        found.append(
            f"CPU offload: {format_size(memory.offloaded)} of states per rank live in host memory (not checked "
            f"against the host's), {candidate.timing.offload:.3g} s of host work and transfers per step"
        )
    for name, size, stride in layout.dimensions():
        link = cluster.link(stride, size)
        if name == "tp":
            found.append(
                f"tensor parallel {size} within a machine ({link}): each layer's weights and activations split"
            )
        elif name == "cp":
            found.append(f"context parallel {size} ({link}): each sequence of {plan.job.setup.seq_len} tokens split")
        elif name == "pp":
            found.append(
                f"pipeline {size} stages over {link}: only activations cross between stages; bubble {timing.bubble:.0%}"
            )
    if layout.checkpointing:
        found.append(
            f"activation checkpointing: activations {format_size(memory.activations_full)} -> "
            f"{format_size(memory.activations_checkpointed)}, one more forward per step"
        )
    found.append(
        f"micro-batch {layout.micro_batch} x accumulation {layout.accumulation} x {layout.data_parallel} "
        f"data-parallel ranks = global batch {plan.global_batch}"
    )
    return found


def _count(number: int) -> str:
    return f"{number / 1e9:,.2f}B" if number >= 1e9 else f"{number / 1e6:,.2f}M"


def format_plan(plan: Plan, top: int = 3) -> str:
    """The plan's text: the cluster and model, then the top layouts with their reasons and commands."""
    shape, cluster = plan.job.shape, plan.cluster
    lines = [
        f"model: {shape.model_type}, {_count(shape.params)} parameters, {shape.num_layers} layers, "
        f"{shape.heads} heads ({shape.kv_heads} kv); sequence {plan.job.setup.seq_len}, global batch "
        f"{plan.global_batch}",
        f"cluster: {cluster.describe()}",
        f"layouts that fit: {len(plan.ranked)} of {plan.tried}",
    ]
    for number, candidate in enumerate(plan.ranked[:top], 1):
        lines.append("")
        lines.append(f"{number}. {candidate.layout.name()}")
        lines += [f"   - {reason}" for reason in reasons(candidate, plan)]
        lines.append(f"   $ {launch_command(candidate, plan)}")
    if plan.refused:
        lines.append("")
        lines.append("not considered: " + "; ".join(f"{name}: {why}" for name, why in sorted(plan.refused.items())))
    return "\n".join(lines)


def candidate_json(candidate: Candidate, plan: Plan) -> dict[str, Any]:
    layout = candidate.layout
    return {
        "layout": layout.name(),
        "family": layout.family,
        "sizes": {
            "dp_replicate": layout.dp_replicate,
            "dp_shard": layout.dp_shard,
            "tp": layout.tp,
            "cp": layout.cp,
            "pp": layout.pp,
        },
        "offload": layout.offload,
        "activation_checkpointing": layout.checkpointing,
        "micro_batch": layout.micro_batch,
        "gradient_accumulation_steps": layout.accumulation,
        "memory": candidate.memory.to_dict(),
        "step_seconds": {
            "total": candidate.timing.total,
            "compute": candidate.timing.compute,
            "communication": candidate.timing.communication,
            "exposed_communication": candidate.timing.exposed,
            "offload": candidate.timing.offload,
        },
        "bytes_sent_per_link": candidate.timing.sent,
        "reasons": reasons(candidate, plan),
        "command": launch_command(candidate, plan),
    }


def plan_json(plan: Plan, top: int = 3) -> dict[str, Any]:
    cluster: Cluster = plan.cluster
    return {
        "cluster": {
            "num_machines": cluster.num_machines,
            "per_machine": cluster.per_machine,
            "device_memory": cluster.device_memory,
            "interconnect": {"within": cluster.intra, "between": cluster.inter},
            "device": cluster.device,
        },
        "model": {"params": plan.job.shape.params, "layers": plan.job.shape.num_layers},
        "global_batch": plan.global_batch,
        "fitting_layouts": len(plan.ranked),
        "layouts": [candidate_json(candidate, plan) for candidate in plan.ranked[:top]],
        "not_considered": plan.refused,
    }
