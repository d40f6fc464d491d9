"""The device mesh on real gloo ranks: accelerate's dimension order, each rank's coordinates, the ranks of every
dimension's group and of the flattened ``dp``, ``dp_shard_cp`` and ``dp_cp`` views; sizes that do not multiply to
the world size are refused on every rank before any group is made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

JOB = "tests.distributed.mesh_job"


def _seen(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def test_four_ranks(tmp_path: Path) -> None:
    """(replicate 2 × shard 2), (shard 2 × tp 2), and a size that does not fit, on 4 ranks."""
    run_ranks(JOB, 4, str(tmp_path), "2,2,1", "1,2,2", "2,2,2")
    seen = _seen(tmp_path, 4)

    hsdp = [s["2,2,1"] for s in seen]
    assert {(tuple(s["names"]), tuple(s["shape"])) for s in hsdp} == {(("dp_replicate", "dp_shard"), (2, 2))}
    assert [s["coordinate"] for s in hsdp] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert [s["groups"]["dp_replicate"] for s in hsdp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [s["groups"]["dp_shard"] for s in hsdp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [s["groups"]["dp_shard_cp"] for s in hsdp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(s["groups"]["dp"] == s["groups"]["dp_cp"] == [0, 1, 2, 3] for s in hsdp)
    assert [s["local_ranks"]["dp"] for s in hsdp] == [0, 1, 2, 3]
    assert all(
        s["sliced_sizes"] == {"dp_replicate": 2, "dp_shard": 2, "dp": 4, "dp_shard_cp": 2, "dp_cp": 4} for s in hsdp
    )

    fsdp_tp = [s["1,2,2"] for s in seen]
    assert {(tuple(s["names"]), tuple(s["shape"])) for s in fsdp_tp} == {(("dp_shard", "tp"), (2, 2))}
    assert [s["coordinate"] for s in fsdp_tp] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert [s["groups"]["tp"] for s in fsdp_tp] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # tp innermost: neighbours
    for view in ("dp_shard", "dp", "dp_shard_cp", "dp_cp"):
        assert [s["groups"][view] for s in fsdp_tp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [s["local_ranks"]["dp"] for s in fsdp_tp] == [0, 0, 1, 1]  # the data-parallel rank: same batch per tp pair
    assert [s["local_ranks"]["tp"] for s in fsdp_tp] == [0, 1, 0, 1]

    assert {s["2,2,2"]["error"] for s in seen} == {
        "ParallelismConfig spans 8 processes (dp_replicate 2 × dp_shard 2 × tp 2 × cp 1 × sp 1) but the job has 4: "
        "make the sizes multiply to 4, or launch 8 processes"
    }


def test_two_ranks_tensor_parallel(tmp_path: Path) -> None:
    """tp 2 alone: one dimension, no data-parallel view (as accelerate); pure replication flattens into dp."""
    run_ranks(JOB, 2, str(tmp_path), "1,1,2", "2,1,1")
    seen = _seen(tmp_path, 2)
    tp = [s["1,1,2"] for s in seen]
    assert [(s["names"], s["shape"], s["coordinate"]) for s in tp] == [(["tp"], [2], [0]), (["tp"], [2], [1])]
    assert [s["groups"] for s in tp] == [{"tp": [0, 1]}] * 2
    ddp = [s["2,1,1"] for s in seen]
    assert [sorted(s["groups"]) for s in ddp] == [["dp", "dp_cp", "dp_replicate"]] * 2
    assert [s["local_ranks"]["dp"] for s in ddp] == [0, 1]
