"""``parallelize`` on 4 real gloo ranks against one process at the same global batch: FSDP2 × TP on (shard 2 × tp 2)
and HSDP on (replicate 2 × shard 2), a tiny Llama (2 layers, hidden 64, 4 heads, 2 KV heads).

float32, one step: the loss, every gradient (``full_tensor()``) and the clipped total norm as one process has them.
float64, four AdamW steps with clipping: the weights too, within 1e-10 (float32 AdamW turns 1e-8 gradient noise into
1e-4 weight moves, whatever the parallelism). transformers computes the loss in float32 in both dtypes, so the loss
differs by float32 summation order (~5e-7 on a loss of ~4.9). Replication alone is left unchanged (DDP's business).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

JOB = "tests.distributed.compose_job"
FSDP_TP, HSDP, REPLICATE = "1,2,2", "2,2,1", "4,1,1"


def _seen(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]


def test_float32_step_matches_one_process(tmp_path: Path) -> None:
    run_ranks(JOB, 4, str(tmp_path), "float32", "1", FSDP_TP, HSDP, REPLICATE)
    for seen in _seen(tmp_path):
        # q_proj sharded by FSDP on dp_shard_cp and by TP on tp; the norm replicated over tp, sharded by FSDP
        assert seen[FSDP_TP]["layout"] == {
            "fsdp_units": 3,
            "q_proj": [["dp_shard_cp", "tp"], ["_S(0, 2)", "S(0)"]],
            "norm": [["dp_shard_cp", "tp"], ["S(0)", "R"]],
        }
        # HSDP: replicated over dp_replicate, sharded over dp_shard_cp
        assert seen[HSDP]["layout"] == {
            "fsdp_units": 3,
            "q_proj": [["dp_replicate", "dp_shard_cp"], ["R", "S(0)"]],
            "norm": [["dp_replicate", "dp_shard_cp"], ["R", "S(0)"]],
        }
        for spec in (FSDP_TP, HSDP):
            got = seen[spec]
            assert got["loss"] <= 1e-5, (spec, got)
            assert got["grad"] <= 1e-5, (spec, got)
            assert got["norm"] <= 1e-6 * max(1.0, got["ref_norm"]), (spec, got)
            assert got["clipped"] <= 1e-6, (spec, got)
        assert seen[REPLICATE]["unchanged"] and seen[REPLICATE]["layout"]["fsdp_units"] == 0


def test_float64_adamw_steps_keep_the_weights(tmp_path: Path) -> None:
    run_ranks(JOB, 4, str(tmp_path), "float64", "4", FSDP_TP, HSDP)
    for seen in _seen(tmp_path):
        for spec in (FSDP_TP, HSDP):
            got = seen[spec]
            assert got["loss"] <= 1e-5, (spec, got)  # the loss is float32 (transformers upcasts logits to float)
            assert max(got[k] for k in ("grad", "norm", "clipped", "weights")) <= 1e-10, (spec, got)
