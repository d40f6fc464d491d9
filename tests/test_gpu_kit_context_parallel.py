"""The GPU kit's ``context_parallel`` step: its dry run through the orchestrator (our ``all_gather`` backend equal to
plain SDPA on a 1-rank gloo group, torch's refused on the CPU), and its comparison finding a model that differs and
a backend that fails without losing the other backend's figures."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks import gpu_check
from benchmarks.gpu_kit import context_parallel_step as step
from benchmarks.gpu_kit.kit import Context

pytestmark = pytest.mark.timeout(300)
STEP = next(s for s in gpu_check.STEPS if s.name == "context_parallel")


@pytest.fixture
def cp_mesh() -> Iterator[object]:
    """A 1-rank gloo group and its 1-D mesh ``cp``, as the step makes them."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


def _context(tmp_path: Path) -> Context:
    return Context("context_parallel", True, "cpu", tmp_path / "work", tmp_path / "result.json")


def test_the_dry_run_through_the_child(tmp_path: Path) -> None:
    report = gpu_check.run_steps([STEP], True, "cpu", tmp_path, 600, work=tmp_path / "work")
    rec = report["steps"]["context_parallel"]
    assert rec["status"] == "ok", rec
    f = rec["figures"]
    assert f["process_group"] == "gloo" and f["mesh"] == "['cp'] [1]" and f["dtype"] == "float32"
    assert f["split_reorders_nothing"] is True and f["auto_backend"] == "all_gather"
    ours = f["all_gather"]
    assert ours["buffers"] == ["input_ids", "labels", "shift_labels", "position_ids"]
    assert ours["shift_labels_before_split"] is True and ours["layers_in_region"] == "2 of 2"
    assert ours["grads_compared"] == "21 of 21"
    for key in ("logits_rel_diff", "loss_rel_diff", "grads_rel_diff"):
        assert ours[key] <= step.TOLERANCE["cpu"], (key, ours)
    assert "torch" not in f and "no cpu kernel" in f["torch_refused_on_cpu"]
    assert any("cp_backend='torch' not run" in note for note in rec["notes"])
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "- all_gather vs plain SDPA: logits " in summary and "- cp_backend='torch' on the CPU: " in summary
    assert "| context_parallel | ok |" in summary


def test_a_model_that_differs_is_a_problem(tmp_path: Path, cp_mesh: object) -> None:
    """The check can fail: a candidate whose one weight moved by 1e-3 differs in logits, loss and gradients."""
    reference = step.tiny_llama("cpu")
    candidate = copy.deepcopy(reference)
    with torch.no_grad():
        candidate.model.layers[1].self_attn.o_proj.weight.add_(1e-3)
    ctx = _context(tmp_path)
    step.compare(ctx, cp_mesh, ["all_gather"], reference=reference, candidate=candidate)
    problems = "\n".join(ctx.problems)
    assert "all_gather: logits differ from plain SDPA" in problems
    assert "all_gather: loss" in problems and "all_gather: gradients differ" in problems
    assert ctx.figures["all_gather"]["logits_rel_diff"] > step.TOLERANCE["cpu"]


def test_a_backend_that_fails_is_recorded_and_the_other_runs(tmp_path: Path, cp_mesh: object) -> None:
    """torch's ring attention forced on the CPU (the step never does) fails in the region; ours still runs clean."""
    ctx = _context(tmp_path)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    step.compare(ctx, cp_mesh, ["torch", "all_gather"])
    assert len(ctx.problems) == 1 and ctx.problems[0].startswith("cp_backend='torch' failed: "), ctx.problems
    assert ctx.figures["all_gather"]["logits_rel_diff"] <= step.TOLERANCE["cpu"]
    assert torch.nn.functional.scaled_dot_product_attention is sdpa  # torch's patch undone on the way out
    lines = step.summarize(ctx.figures)
    assert any(line.startswith("all_gather vs plain SDPA: ") for line in lines)
    assert not any(line.startswith("torch") for line in lines)
