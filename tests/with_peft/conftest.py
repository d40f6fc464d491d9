"""The peft suite: every test here is marked ``peft`` and skipped without peft, unless CI requires peft.

CI's peft step sets ``TRAINER_EXT_REQUIRE_PEFT=1``: there a peft that does not import stops the run with an error
instead of skipping every test (a skipped suite would pass silently).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REQUIRED = os.environ.get("TRAINER_EXT_REQUIRE_PEFT") == "1"

try:
    import peft  # noqa: F401
except ImportError as error:
    if REQUIRED:
        pytest.exit(
            f"TRAINER_EXT_REQUIRE_PEFT=1 but peft does not import ({error}); install the extra: pip install -e '.[peft]'",
            returncode=1,
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of this folder ``peft`` (``-m peft`` selects them, ``-m 'not peft'`` leaves them out)."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.peft)
