"""accelerate's own example scripts (vendored unmodified in examples/upstream/) run with stock accelerate and with
trainer_ext, only their import lines switched, on 1 and 2 CPU processes: every rank's per-step loss, learning rate
and ``sync_gradients``, metric results, logged values and final weights compared (examples/compare.py).

The stock side needs accelerate, which the main environment must not have: the tests are skipped there, unless
``TRAINER_EXT_REQUIRE_ACCELERATE=1`` (CI), which makes a missing accelerate an error. ``EXAMPLES_PARITY_RESULTS=DIR``
keeps the records. See README.md ("accelerate's example scripts").
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.stock_side import require_accelerate, skip_without_accelerate
from tests.parity_harness.compare import check
from tests.parity_harness.registry import selected

from .examples.cases import CASES, NPROCS
from .examples.compare import BATCH_TIMEOUT_S, run_both
from .examples.standins import build

pytestmark = [
    pytest.mark.parity,
    skip_without_accelerate("run in the side venv (tests/accelerator_parity/README.md)"),
]

RUNS = [(name, nproc) for name in CASES for nproc in NPROCS]


@pytest.fixture(scope="module")
def reports(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The selected scripts that can run here, each under both implementations (the two batches side by side)."""
    # not skipped: CI requires accelerate
    require_accelerate("run in the side venv (tests/accelerator_parity/README.md)")
    chosen = selected(request, "script", "nproc")
    runnable = [run for run in RUNS if run in chosen and CASES[run[0]].missing() is None]
    if not runnable:
        return {}
    outdir = Path(os.environ.get("EXAMPLES_PARITY_RESULTS") or tmp_path_factory.mktemp("examples-parity")).resolve()
    # the batches' time limit: conftest scales a subprocess's timeout by the machine's load (tests/helpers/slowness)
    return run_both(runnable, outdir, build(outdir / "standins"), BATCH_TIMEOUT_S)


@pytest.mark.parametrize(("script", "nproc"), RUNS, ids=[f"{name}-{n}proc" for name, n in RUNS])
def test_example_script(script: str, nproc: int, reports: dict) -> None:
    missing = CASES[script].missing()
    if missing:
        pytest.skip(missing)
    check(reports[(script, nproc)])
