"""Drop-in parity for hand-written loops: each accelerate-style script observes the same with
``accelerate.Accelerator`` and with ``trainer_ext.Accelerator``, on 1 and 2 CPU processes.

The stock side needs accelerate, which the main environment must not have: the tests are skipped there, unless
``TRAINER_EXT_REQUIRE_ACCELERATE=1`` (CI), which makes a missing accelerate an error. See README.md for the
environment that runs them. ``ACCELERATOR_PARITY_RESULTS=DIR`` keeps the JSON results.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.stock_side import require_accelerate, skip_without_accelerate
from tests.parity_harness.compare import check
from tests.parity_harness.registry import selected

from .registry import CASES
from .run_all import run_many

pytestmark = [
    pytest.mark.parity,
    skip_without_accelerate("run in the side venv (tests/accelerator_parity/README.md)"),
]


@pytest.fixture(scope="module")
def reports(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The selected cases, each run once under both implementations (two runs at a time)."""
    # not skipped: CI requires accelerate
    require_accelerate("run in the side venv (tests/accelerator_parity/README.md)")
    chosen = selected(request, "scenario", "nproc")
    outdir = Path(os.environ.get("ACCELERATOR_PARITY_RESULTS") or tmp_path_factory.mktemp("accelerator-parity"))
    return run_many([case for case in CASES if case in chosen], outdir)


@pytest.mark.parametrize(("scenario", "nproc"), CASES, ids=[f"{name}-{n}proc" for name, n in CASES])
def test_accelerator_parity(scenario: str, nproc: int, reports: dict) -> None:
    check(reports[(scenario, nproc)])
