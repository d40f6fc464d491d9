"""The stock side of the parity tests: accelerate, which only the side environment has (the main one must not).

Without it the parity tests skip; ``TRAINER_EXT_REQUIRE_ACCELERATE=1`` (CI) makes a missing accelerate an error
instead (a skipped suite would pass silently).
"""

from __future__ import annotations

import os

import pytest

REQUIRED = os.environ.get("TRAINER_EXT_REQUIRE_ACCELERATE") == "1"

try:
    import accelerate  # noqa: F401  (the stock side's; the scripts run in their own processes)
except ImportError as exc:
    NO_ACCELERATE: str | None = f"{type(exc).__name__}: {exc}"
else:
    NO_ACCELERATE = None


def skip_without_accelerate(where: str) -> pytest.MarkDecorator:
    """Skip where accelerate is missing, unless CI requires it; ``where`` says how to get the side environment."""
    return pytest.mark.skipif(
        NO_ACCELERATE is not None and not REQUIRED,
        reason=f"the stock side needs accelerate, which this environment must not have: {where}",
    )


def require_accelerate(where: str) -> None:
    """Stop the session when accelerate does not import (called where a skipped test would have been required)."""
    if NO_ACCELERATE is not None:
        pytest.exit(
            f"TRAINER_EXT_REQUIRE_ACCELERATE=1 but accelerate does not import ({NO_ACCELERATE}); the stock side needs "
            f"it: {where}",
            returncode=1,
        )
