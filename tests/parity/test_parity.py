"""Drop-in parity: ordinary Trainer scripts observe the same under transformers+accelerate and under trainer_ext.

Each scenario (``scenarios.py``) runs under both implementations in separate processes; a test per scenario
fails on any difference that ``compare.ALLOWED`` does not list. Needs accelerate for the stock side, so it is
skipped in the main environment: see tests/parity/README.md for the environment that runs it.

CI sets ``TRAINER_EXT_REQUIRE_ACCELERATE=1``: there an accelerate that does not import stops the run with an error
instead of skipping every scenario (a skipped suite would pass silently).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.stock_side import require_accelerate, skip_without_accelerate
from tests.parity_harness.compare import check
from tests.parity_harness.registry import selected

from .compare import compare
from .run_all import run_both, scenario_names

OURS = os.environ.get("PARITY_OURS", "ours")  # "ours+accelerate": trainer_ext with accelerate importable
pytestmark = [
    pytest.mark.parity,
    skip_without_accelerate("run in the parity venv (tests/parity/README.md)"),
]


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The selected scenarios, run once under both implementations (side by side, one fork per scenario)."""
    require_accelerate(
        "run the parity suite in the peft environment, pip install -e '.[dev,peft]' (tests/parity/README.md)"
    )  # not skipped: CI requires accelerate
    chosen = set(selected(request, "scenario"))
    names = [name for name in scenario_names() if name in chosen]
    outdir = Path(os.environ.get("PARITY_RESULTS") or tmp_path_factory.mktemp("parity"))
    return run_both(names, outdir, OURS)


@pytest.mark.parametrize("scenario", scenario_names())
def test_parity(scenario: str, results: dict[str, dict]) -> None:
    check(compare(results[scenario]["stock"], results[scenario]["ours"], scenario))
