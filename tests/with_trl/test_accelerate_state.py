"""accelerate's own helpers, called directly by TRL, agree with our engine on 2 real gloo ranks (issue: rank 1
gathered nothing, ``set_seed(device_specific=True)`` refused to run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from tests.helpers.ranks import run_ranks  # noqa: E402


@pytest.mark.parametrize("early", [False, True], ids=["untouched", "set-up-early-by-a-library"])
def test_accelerates_free_functions_see_our_processes(tmp_path: Path, early: bool) -> None:
    run_ranks("tests.with_trl.accelerate_state_job", 2, str(tmp_path), *(["early"] if early else []))
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["engine"] == "Engine"
    assert got["gather"] == [0.0, 1.0, 10.0, 11.0]
    assert got["gather_object"] == [0, 1]
    assert got["seeds"] == [11, 12]
    assert got["broadcast"] == ["from rank 0"]
