"""The plan of a job on a cluster: every layout the engine runs, its per-rank memory and step time, ranked.

Each layout's micro-batch is the largest divisor of its share of the global batch whose peak fits 90 % of the
device (the rest for the allocator's fragmentation, the CUDA context and communication buffers); the global batch
stays the same in every layout. Layouts that fit are ranked by the step time of :mod:`trainer_ext.plan.timing`,
to 3 significant digits, then by fewer parallel dimensions, then the simpler family (DDP, FSDP2, ZeRO-1/2/3, HSDP; no
offload), then by memory. When none fits, :func:`smallest_change` says what would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer_ext.errors import ConfigError
from trainer_ext.estimate.breakdown import Breakdown, estimate
from trainer_ext.estimate.setup import Setup, setup_from_values
from trainer_ext.plan.cluster import Cluster
from trainer_ext.plan.layouts import LAYOUT_FLAGS, Layout, divisors, families, fixed_by_flags, model_sizes
from trainer_ext.plan.timing import Timing, step_timing

HEADROOM = 0.9  # the share of a device's memory a layout's peak may take


@dataclass(frozen=True)
class Candidate:
    """A layout with its Setup, per-rank memory and step time."""

    layout: Layout
    setup: Setup
    memory: Breakdown
    timing: Timing


@dataclass
class Plan:
    """The ranked layouts that fit (``ranked``), the model sizes refused and why, and what the plan assumed."""

    job: Any
    cluster: Cluster
    global_batch: int
    ranked: list[Candidate]
    refused: dict[str, str] = field(default_factory=dict)  # "tp 8" -> why the model refuses it
    tried: int = 0  # layouts enumerated (sizes and family; each tried with and without checkpointing)
    train_argv: list[str] = field(default_factory=list)

    @property
    def limit(self) -> int:
        return int(self.cluster.device_memory * HEADROOM) if self.cluster.device_memory else 0


class _Checks:
    """The model checks ``train`` applies to each parallel size, memoized: None or the reason it refuses."""

    def __init__(self, job: Any) -> None:
        self.job, self.found = job, {}

    def __call__(self, name: str, size: int) -> str | None:
        if size == 1:
            return None
        if (name, size) not in self.found:
            try:
                self._check(name, size)
                self.found[name, size] = None
            except ConfigError as error:
                self.found[name, size] = str(error)
        return self.found[name, size]

    def _check(self, name: str, size: int) -> None:
        from trainer_ext.estimate.job import check_pp_model, check_tp_model
        from trainer_ext.job.parallel import check_cp_job, check_model_for_cp, check_pp_job, parallelism_from_sizes

        args, model = self.job.args, self.job.model
        if name == "tp":
            check_tp_model(model, size, "the model", vocab=bool(args.model_name_or_path))
        elif name == "cp":
            check_cp_job(vars(args), size)
            check_model_for_cp(model.config, size, "the model")
        else:
            check_pp_job(vars(args), size)
            check_pp_model(model, parallelism_from_sizes({"pp_size": size}, None, "1f1b", None))


def base_values(values: dict[str, Any], job: Any) -> dict[str, Any]:
    """The job's flag values without its layout: what every candidate shares (precision, optimizer)."""
    base = {key: value for key, value in values.items() if key not in LAYOUT_FLAGS}
    base.update(optim=getattr(job.args.optim, "value", job.args.optim), optim_args=job.args.optim_args)
    return base


def candidate_setup(base: dict[str, Any], layout: Layout, seq_len: int, device: str) -> Setup:
    """The estimator's Setup of ``layout``: read from its flag values exactly as ``train``'s start-up reads them."""
    return setup_from_values({**base, **layout.values()}, layout.world, seq_len, device_type=device)


def _fit(
    layout: Layout,
    per_rank: int,
    fits: Callable[[Layout], bool],
    limit: int,
    preferred: int,
    host_limited: bool = False,
) -> Layout | None:
    """``layout`` with the largest micro-batch (a divisor of ``per_rank``) that fits, its accumulation and pipeline
    microbatches; without a limit the largest divisor up to ``preferred``. None when not even the smallest fits."""
    options = divisors(per_rank)
    if layout.pp > 1:
        options = [d for d in options if d >= layout.pp] or [per_rank]

    def sized(micro: int) -> Layout:
        microbatches = micro if layout.pp > 1 else 0
        return layout.replace(micro_batch=micro, accumulation=per_rank // micro, pp_microbatches=microbatches)

    if not limit and not host_limited:
        return sized(max([d for d in options if d <= preferred] or options[:1]))
    if not fits(sized(options[0])):
        return None
    low, high = 0, len(options) - 1
    while low < high:  # fits(options[low]); find the last that fits
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(sized(options[middle])) else (low, middle - 1)
    return sized(options[low])


def make_plan(train_argv: Sequence[str], cluster: Cluster, global_batch: int | None = None, job: Any = None) -> Plan:
    """Enumerate, estimate and rank every layout of the ``trainer-ext train`` job ``train_argv`` on ``cluster``."""
    from trainer_ext.estimate.job import job_from_argv
    from trainer_ext.job.flags import parse_train_values

    values, _, _ = parse_train_values(list(train_argv))
    fixed = fixed_by_flags(values)
    job = job or job_from_argv(list(train_argv), cluster.world)
    user = job.setup
    global_batch = global_batch or user.micro_batch * user.accumulation * user.data_parallel
    if global_batch < 1:
        raise ConfigError(f"--global_batch_size must be at least 1, got {global_batch}")
    base = base_values(values, job)
    checks = _Checks(job)
    plan = Plan(job, cluster, global_batch, [], train_argv=list(train_argv))
    for name in ("tp", "cp", "pp"):
        for size in divisors(cluster.world)[1:]:
            reason = checks(name, size)
            if reason is not None and (name != "tp" or cluster.per_machine % size == 0):
                plan.refused[f"{name} {size}"] = reason
    limit = plan.limit
    seq_len, device = user.seq_len, cluster.device

    host = int(cluster.host_memory * HEADROOM / cluster.per_machine) if cluster.host_memory else 0

    def fits(layout: Layout) -> bool:
        memory = estimate(job.shape, candidate_setup(base, layout, seq_len, device))
        return (not limit or memory.peak <= limit) and (not host or memory.offloaded <= host)

    found: list[Candidate] = []
    for tp, cp, pp in model_sizes(cluster, checks, fixed):
        for layout in families(cluster.world, tp, cp, pp, fixed):
            if global_batch % layout.data_parallel:
                continue
            per_rank = global_batch // layout.data_parallel
            plan.tried += 1
            for checkpointing in (False, True):
                sized = _fit(
                    layout.replace(checkpointing=checkpointing), per_rank, fits, limit, user.micro_batch, bool(host)
                )
                if sized is None:
                    continue
                setup = candidate_setup(base, sized, seq_len, device)
                memory = estimate(job.shape, setup)
                found.append(Candidate(sized, setup, memory, step_timing(job.shape, setup, sized, cluster)))
    found.sort(key=_rank_key)
    plan.ranked = _distinct(found)
    return plan


# among layouts as fast as each other (to 3 significant digits), the simpler first
SIMPLER = ("single", "ddp", "fsdp", "zero1", "zero2", "zero3", "hsdp")


def _rank_key(candidate: Candidate) -> tuple:
    layout = candidate.layout
    simple = (layout.offload, not layout.reshard, SIMPLER.index(layout.family))
    return (float(f"{candidate.timing.score:.3g}"), len(layout.dimensions()), *simple, candidate.memory.peak)


def _distinct(found: list[Candidate]) -> list[Candidate]:
    """One candidate per layout without its batch and checkpointing choice (the faster one)."""
    seen, kept = set(), []
    for candidate in found:
        key = dataclasses.replace(candidate.layout, checkpointing=False, micro_batch=1, accumulation=1)
        key = key.replace(pp_microbatches=0)
        if key not in seen:
            seen.add(key)
            kept.append(candidate)
    return kept


def smallest_change(train_argv: Sequence[str], cluster: Cluster, global_batch: int, job: Any) -> list[str]:
    """What would make some layout fit when none does, smallest first of each kind: more device memory, more
    devices, a shorter sequence."""
    from trainer_ext.values import format_size

    changes: list[str] = []
    lowest = _lowest_peak(train_argv, cluster, global_batch, job)
    if lowest is not None:
        peak, layout = lowest
        gib = 1 << 30
        needed = -(-int(peak / HEADROOM) // gib) * gib
        changes.append(f"--device_memory {needed // gib}GiB ({layout.name()} needs {format_size(peak)} per rank)")
    if cluster.host_memory:
        unchecked = make_plan(train_argv, dataclasses.replace(cluster, host_memory=0), global_batch, job=job)
        if unchecked.ranked:
            least = min(unchecked.ranked, key=lambda c: c.memory.offloaded)
            gib = 1 << 30
            needed = -(-int(least.memory.offloaded * cluster.per_machine / HEADROOM) // gib) * gib
            changes.append(f"--host_memory {needed // gib}GiB ({least.layout.name()} offloads to the host)")
    for machines, per_machine in _bigger(cluster):
        bigger = dataclasses.replace(cluster, num_machines=machines, per_machine=per_machine)
        plan = make_plan(train_argv, bigger, global_batch, job=dataclasses.replace(job))
        if plan.ranked:
            where = f"--num_machines {machines} " if machines > 1 else ""
            changes.append(f"{where}--gpus_per_machine {per_machine} ({plan.ranked[0].layout.name()})")
            break
    seq_len = job.setup.seq_len
    while seq_len > 128:
        seq_len //= 2
        shorter = dataclasses.replace(job, setup=job.setup.replace(seq_len=seq_len))
        plan = make_plan(train_argv, cluster, global_batch, job=shorter)
        if plan.ranked:
            changes.append(f"--max_seq_length {seq_len} ({plan.ranked[0].layout.name()})")
            break
    return changes


def _lowest_peak(
    train_argv: Sequence[str], cluster: Cluster, global_batch: int, job: Any
) -> tuple[int, Layout] | None:
    """The smallest per-rank peak of any layout at micro-batch 1 with activation checkpointing, and its layout."""
    unlimited = dataclasses.replace(cluster, device_memory=0)
    plan = make_plan(train_argv, unlimited, global_batch, job=job)
    best = None
    from trainer_ext.job.flags import parse_train_values

    values, _, _ = parse_train_values(list(train_argv))
    base = base_values(values, job)
    for candidate in plan.ranked:
        per_rank = global_batch // candidate.layout.data_parallel
        small = candidate.layout.replace(checkpointing=True, micro_batch=1, accumulation=per_rank)
        small = small.replace(pp_microbatches=small.pp if small.pp > 1 else 0)
        peak = estimate(job.shape, candidate_setup(base, small, job.setup.seq_len, cluster.device)).peak
        if best is None or peak < best[0]:
            best = (peak, small)
    return best


def _bigger(cluster: Cluster) -> list[tuple[int, int]]:
    """Clusters to try, smallest first: more devices in the machine (up to 8), then more machines (up to 64)."""
    options = [(1, n) for n in (2, 4, 8) if cluster.num_machines == 1 and n > cluster.per_machine]
    per_machine = max(cluster.per_machine, 8) if cluster.num_machines == 1 else cluster.per_machine
    options += [(m, per_machine) for m in (2, 4, 8, 16, 32, 64) if m > cluster.num_machines]
    return options
