"""The pipeline schedules by the names users pick them with, how many stages each puts on a rank, and the share of
a step each rank idles (the bubble). Imports no torch, so the CLI, ``estimate`` and the start-up block can use it."""

from __future__ import annotations

from trainer_ext.errors import ConfigError

# name -> (torch.distributed.pipelining class, stages per rank, stage layout across ranks)
#   loop: rank r holds stages r, r + pp, ...;  v: rank r holds stages r and 2·pp − 1 − r (a V)
SCHEDULES: dict[str, tuple[str, int, str]] = {
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", 2, "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", 2, "v"),
}


def check_schedule(name: str) -> None:
    """ConfigError naming the known schedules when ``name`` is not one."""
    if name not in SCHEDULES:
        raise ConfigError(f"pp_schedule {name!r} is unknown: choose {', '.join(SCHEDULES)}")


def stages_per_rank(name: str) -> int:
    """How many model chunks (stages) the schedule ``name`` puts on each rank."""
    check_schedule(name)
    return SCHEDULES[name][1]


def stage_ids(name: str, pp_rank: int, pp_size: int) -> list[int]:
    """The stage indices rank ``pp_rank`` of ``pp_size`` holds under schedule ``name``, in model order."""
    _, per_rank, layout = SCHEDULES[name]
    if per_rank == 1:
        return [pp_rank]
    if layout == "v":
        return sorted({pp_rank, 2 * pp_size - 1 - pp_rank})
    return [pp_rank + k * pp_size for k in range(per_rank)]


def owner_of_stage(name: str, stage: int, pp_size: int) -> int:
    """The pp rank that holds ``stage`` under schedule ``name``."""
    return next(r for r in range(pp_size) if stage in stage_ids(name, r, pp_size))


def default_microbatches(name: str, pp_size: int) -> int:
    """Microbatches per schedule run when ``pp_microbatches`` is unset: one per stage, the fewest every schedule
    takes (more shrink the bubble, at a smaller matrix size)."""
    return pp_size * stages_per_rank(name)


def bubble_fraction(name: str, pp_size: int, microbatches: int) -> float:
    """The share of a step a rank idles, from the schedules' standard model with equal stage times and backward =
    2 × forward: GPipe and 1F1B (p − 1)/(m + p − 1); interleaving over v chunks per rank divides the fill and drain
    by v; the zero-bubble schedules fill most of what is left with weight-gradient work (counted as a third)."""
    if pp_size <= 1:
        return 0.0
    per_rank = stages_per_rank(name)
    fill = (pp_size - 1) / per_rank
    bubble = fill / (microbatches + fill)
    if "zero_bubble" in name:
        bubble /= 3
    return bubble


def describe(pp_size: int, name: str, microbatches: int | None, ranges: list[tuple[int, int]] | None = None) -> str:
    """The pipeline in one phrase, e.g. ``2 stages (layers 0-3 | 4-7), 1f1b, 4 microbatches, bubble 20%``: the layers
    when ``ranges`` are known, the schedule's default microbatches when ``microbatches`` is None."""
    stages = pp_size * stages_per_rank(name)
    count = microbatches or default_microbatches(name, pp_size)
    on = f" on {pp_size} ranks" if stages > pp_size else ""
    layers = " (layers " + " | ".join(f"{a}-{b - 1}" for a, b in ranges) + ")" if ranges else ""
    return f"{stages} stages{on}{layers}, {name}, {count} microbatches, bubble {bubble_fraction(name, pp_size, count):.0%}"
