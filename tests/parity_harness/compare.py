"""What every comparison of stock and ours shares: how values are printed and measured, and how a report fails.

Each scenario set keeps its own rules (what is compared, the tolerances, the deliberate differences and their
reasons); its report answers ``ok`` and ``text()``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class Outcome(Protocol):
    """A comparison's report, as the harness reads it."""

    @property
    def ok(self) -> bool: ...

    def text(self) -> str: ...


def short(value: Any, limit: int) -> str:
    """``value`` as JSON (a string as its repr), cut to ``limit`` characters."""
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def relative(a: float, b: float) -> float:
    """``|a - b|`` relative to the larger magnitude (0 when equal; inf where one is NaN or infinite)."""
    if a == b:
        return 0.0
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def worst_of(worst: dict[str, float], kind: str, error: float) -> None:
    """Keep in ``worst`` the largest ``error`` seen per ``kind`` (pass or fail)."""
    worst[kind] = max(worst.get(kind, 0.0), error)


def check(report: Outcome) -> None:
    """A parity test's assertion: print the report, fail the test (no traceback: the report says it) unless ok."""
    import pytest

    print(report.text())
    if not report.ok:
        pytest.fail(report.text(), pytrace=False)


def compare_main(compare_files: Callable[[Path, Path], Outcome], argv: list[str] | None, description: str) -> int:
    """A set's ``python -m ....compare STOCK.json OURS.json``: print the report; exit status 1 unless ok."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("stock", type=Path, help="stock's result")
    parser.add_argument("ours", type=Path, help="ours' result")
    options = parser.parse_args(argv)
    report = compare_files(options.stock, options.ours)
    print(report.text())
    return 0 if report.ok else 1
