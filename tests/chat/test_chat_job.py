"""The sft and dpo jobs end to end through ``trainer_ext.train``: 1 process vs 2 (DDP, and FSDP2 with packing for
SFT), and every run stopped at step 2 and resumed ends bitwise equal to its uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.chat import chat_job_ranks
from tests.helpers.ranks import launch_once

NAMES = list(chat_job_ranks.JOBS)


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chat_one")
    launch_once(out, "1-rank chat jobs", chat_job_ranks, 1)
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chat_two")
    launch_once(out, "2-rank chat jobs", chat_job_ranks, 2, timeout=900)
    return out


def _losses(out: Path, name: str, kind: str) -> list[float]:
    return json.loads((out / name / f"{kind}_losses.json").read_text())


def _weights(out: Path, name: str, kind: str) -> dict[str, torch.Tensor]:
    return load_file(out / name / f"{kind}.safetensors")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("world", ["one", "two"])
def test_a_resumed_job_ends_bitwise_equal(name: str, world: str, request: pytest.FixtureRequest) -> None:
    out = request.getfixturevalue(world)
    assert len(_losses(out, name, "whole")) == chat_job_ranks.STEPS
    assert _losses(out, name, "resumed")[-2:] == _losses(out, name, "whole")[-2:]
    whole, resumed = _weights(out, name, "whole"), _weights(out, name, "resumed")
    assert whole.keys() == resumed.keys()
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key


@pytest.mark.parametrize("name", NAMES)
def test_two_processes_train_as_one(name: str, one: Path, two: Path) -> None:
    first, second = _losses(one, name, "whole"), _losses(two, name, "whole")
    assert len(first) == len(second) == chat_job_ranks.STEPS
    for a, b in zip(first, second, strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (first, second)
    assert first[0] != first[-1]  # it trained
    a, b = _weights(one, name, "whole"), _weights(two, name, "whole")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=5e-5)  # Adam scales tiny gradient differences
