"""Research B19: device_map='auto' inside a distributed job works per rank instead of being refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.ranks import run_ranks
from tests.inference.dispatch_models import make_llama, prompt
from trainer_ext.inference.devices import available_cpu_memory

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_each_rank_dispatches_its_own_copy(tmp_path: Path) -> None:
    out, offload = tmp_path / "out", tmp_path / "offload"
    out.mkdir()
    run_ranks("tests.inference.dispatch_ranks", 2, str(out), str(offload))
    result = json.loads((out / "result.json").read_text())
    expected = make_llama().generate(prompt(batch=4), max_new_tokens=6, do_sample=False)
    assert result["tokens"] == expected.tolist()
    assert result["folders"] == ["rank0", "rank1"]  # ranks never write the same offload files
    assert result["device_map"]["model.layers"] == "disk"
    # default budgets: each of the 2 ranks on this node gets half of the RAM (minus the margin)
    for budget in result["budgets"]:
        assert budget["cpu"] < 0.5 * available_cpu_memory() * 1.2
