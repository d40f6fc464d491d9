"""Bounds on the report's work, so that a very long run (or a crafted log) draws in seconds: each figure draws at
most so many points per line, marks, panels and sessions, and the tables list at most so many rows. What is left
out is said on the page. Also: text for matplotlib taken literally (a ``$`` is no math)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

MAX_POINTS = 2000  # points per drawn line (evenly thinned beyond; first and last kept)
MAX_MARKS = 100  # checkpoint or resume lines per run on one axis
MAX_PANELS = 12  # eval metric panels
MAX_SESSIONS = 100  # sessions drawn on the timeline (the newest)
MAX_ROWS = 100  # rows per kind in the events table (the newest)
MAX_METRICS = 30  # metrics named in one summary cell


def spread(items: Sequence[T], most: int) -> list[T]:
    """At most ``most`` of ``items``, evenly spaced, the first and the last kept."""
    count = len(items)
    if count <= most:
        return list(items)
    if most <= 1:
        return list(items[-1:])
    return [items[round(i * (count - 1) / (most - 1))] for i in range(most)]


def thin(xs: Sequence[float], ys: Sequence[float], most: int = MAX_POINTS) -> tuple[list[float], list[float]]:
    """A line of at most ``most`` points: every k-th point, the first and the last kept."""
    if len(xs) <= most:
        return list(xs), list(ys)
    keep = spread(range(len(xs)), most)
    return [xs[i] for i in keep], [ys[i] for i in keep]


def literal(text: object) -> str:
    """``text`` as matplotlib shows it verbatim: its ``$`` escaped, so a ``$…$`` in a name is not parsed as math."""
    return str(text).replace("$", r"\$")


def left_out(what: str, shown: int, total: int) -> str:
    """The note for a bounded list: '<what>: 100 of 12,345 shown'."""
    return f"{what}: {shown:,} of {total:,} shown"
