"""BarrierTimeoutError says how long the rank actually waited (and the timeout), not the timeout alone: a rank
that crashed ends the barrier long before the timeout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


@pytest.mark.parametrize("gone", [0, 1])
def test_the_error_states_the_time_waited_and_the_timeout(tmp_path: Path, gone: int) -> None:
    run_ranks("tests.callbacks.barrier_waited_job", 2, str(tmp_path), str(gone), timeout=200)
    waiter = 1 - gone
    text = (tmp_path / f"error{waiter}.txt").read_text()
    assert "before checkpoint save at step 7" in text, text
    found = re.search(r"after waiting (\d+(?:\.\d+)?) s \(timeout 600 s\)", text)
    assert found is not None, text
    assert float(found.group(1)) < 600, text  # the other rank was gone: no rank can have waited the whole timeout
    assert "within 600 s" not in text, text
    assert "\n" not in text
