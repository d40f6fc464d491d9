"""Tensor parallelism from the model's own plan on 2 real gloo ranks against one process with the same weights and
batch: a tiny Llama, a tiny Qwen2 (biased q/k/v) and a Llama with tied word embeddings.

float32, one step: the loss, every gradient (``full_tensor()``) and the clipped total norm as one process has them.
float64, five AdamW steps with clipping: the weights too, within 1e-10. (In float32, AdamW's first update is about lr·sign(g), so a
gradient of 1e-8 whose last bits differ moves a weight by 1e-4 whatever the parallelism: the weights are compared
where rounding is not the question.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

JOB = "tests.distributed.tensor_parallel_job"
# qwen3: its q_norm/k_norm read head-split activations ("replicated_with_grad_allreduce"): gradients summed over tp
ARCHS = ("llama", "qwen2", "qwen3", "llama+tied")


def _seen(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_float32_step_matches_one_process_and_refusals(tmp_path: Path) -> None:
    run_ranks(JOB, 2, str(tmp_path), "float32", "1", *ARCHS, "refusals")
    for seen in _seen(tmp_path):
        for arch in ARCHS:
            got = seen[arch]
            assert got["dtensors"] > 0 and got["taken_as_is"], arch
            assert got["tied"] == arch.endswith("+tied"), arch
            assert got["loss"] <= 1e-6, (arch, got)
            assert got["grad"] <= 1e-5, (arch, got)
            assert got["norm"] <= 1e-6 * max(1.0, got["ref_norm"]), (arch, got)
            assert got["inf_norm"] <= 1e-6, (arch, got)
            assert got["clipped"] <= 1e-6, (arch, got)
            # the parameters the plan leaves whole are replicated DTensors too: torch's own clip_grad_norm_ (and
            # foreach/fused optimizers), which refuse a mix of plain tensors and DTensors, take the model
            assert got["all_dtensors"] and got["stock_clip"].startswith("ok "), got["stock_clip"]
        refused = seen["refusals"]
        assert refused["heads"] == (
            "tensor parallelism over 2 ranks needs num_attention_heads (3) divisible by 2: "
            "choose a tp_size that divides 3"
        )
        assert refused["kv_heads"].startswith("tensor parallelism over 2 ranks needs num_key_value_heads (1) ")
        assert refused["intermediate"].startswith("tensor parallelism over 2 ranks needs intermediate_size (127) ")
        assert refused["vocab"].startswith("tensor parallelism over 2 ranks needs model.embed_tokens.num_embeddings")
        assert refused["style"].startswith(
            "tensor-parallel plan entry 'model.layers.*.mlp.down_proj' asks for style 'local_rowwise'"
        )
        assert refused["typo"].startswith("tensor-parallel plan entry 'model.layers.*.mlp.dwn_proj' names no module")
        assert all("\n" not in line for line in refused.values())


def test_float64_adamw_steps_keep_the_weights(tmp_path: Path) -> None:
    run_ranks(JOB, 2, str(tmp_path), "float64", "5", "llama", "qwen2", "qwen3")
    for seen in _seen(tmp_path):
        for arch in ("llama", "qwen2", "qwen3"):
            got = seen[arch]
            # the asked tolerances are 1e-6 (loss, norm) and 1e-5 (gradients, weights); float64 reaches ~1e-15
            assert max(got[k] for k in ("loss", "norm", "inf_norm", "clipped", "grad", "weights")) <= 1e-10, got
