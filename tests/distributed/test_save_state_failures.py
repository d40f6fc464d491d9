"""A save that fails on one rank fails on every rank at once, and the previous checkpoint stays loadable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.distributed


def test_a_full_disk_on_the_main_process_fails_the_save_everywhere(tmp_path: Path) -> None:
    run_ranks("tests.distributed.save_failure_job", 2, str(tmp_path), timeout=300)
    main, other = (json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in (0, 1))
    assert main["raised"].startswith("OSError") and "No space left" in main["raised"]
    assert other["raised"].startswith("CheckpointError")
    assert "rank 0" in other["raised"] and "No space left" in other["raised"]
    assert other["waited"] < 60  # not the process group's 30-minute timeout
    assert main["previous_loads"] and other["previous_loads"]
