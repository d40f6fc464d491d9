"""The TRL suite: every test here is marked ``trl`` and skipped without trl, unless CI requires trl.

trl installs accelerate, so these tests run in their own environment (CI's TRL step sets ``TRAINER_EXT_REQUIRE_TRL=1``:
a trl that does not import stops the run instead of skipping every test).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REQUIRED = os.environ.get("TRAINER_EXT_REQUIRE_TRL") == "1"

try:
    import trl  # noqa: F401
except ImportError as error:
    if REQUIRED:
        pytest.exit(f"TRAINER_EXT_REQUIRE_TRL=1 but trl does not import ({error}); see tests/with_trl", returncode=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of this folder ``trl`` (``-m trl`` selects them, ``-m 'not trl'`` leaves them out)."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.trl)
