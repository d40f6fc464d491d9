"""Sharded checkpoints of an N-D model across meshes, on 2 real gloo ranks and one process: a tiny Llama trained
6 AdamW steps in float32, checkpointed after step 3 (model and optimizer) and resumed on a fresh model.

Resuming on the same mesh (tensor parallel over 2 ranks) is bitwise the uninterrupted run; on another mesh (one
process with no process group, FSDP2 over 2 ranks, one process -> tensor parallel) within 1e-6 (float32 is
enough: after the saved steps AdamW's second moments are non-zero, so the last-bit differences of another
layout's gradients stay last-bit differences in the weights, 1.2e-7 seen). Resuming without the optimizer state
moves the weights by ~5e-2: the comparisons see a checkpoint that forgets it. The consolidated export reloads with
``from_pretrained`` on one process and gives the in-memory logits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.mesh_checkpoint_job import STEPS, build, one_process, probe, resumed
from tests.helpers.ranks import run_ranks
from trainer_ext.distributed.mesh.checkpoint import load_sharded, save_sharded
from trainer_ext.errors import ConfigError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

JOB = "tests.distributed.mesh_checkpoint_job"
ACROSS = 1e-6


@pytest.fixture(autouse=True)
def _environment_kept() -> Iterator[None]:
    """Building a model in this process sets TORCHINDUCTOR_CACHE_DIR (an import's default), which sends later rank
    runs to torchrun instead of the warm fork server: the variables the in-process work added are dropped again."""
    before = set(os.environ)
    yield
    _drop_added(before)


def _drop_added(before: set[str]) -> None:
    for name in set(os.environ) - before:
        del os.environ[name]


def _run(out: Path, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return json.loads((out / f"{name}.json").read_text()), load_file(str(out / f"{name}.safetensors"))


def _differences(out: Path, resumed: str, reference: str) -> tuple[float, float]:
    """(largest loss difference over the resumed steps, largest weight difference at the end)."""
    losses, weights = _run(out, resumed)
    ref_losses, ref_weights = _run(out, reference)
    assert len(ref_losses) == STEPS and weights.keys() == ref_weights.keys()
    loss = max(abs(a - b) for a, b in zip(losses, ref_losses[-len(losses) :], strict=True))
    return loss, max((weights[k] - ref_weights[k]).abs().max().item() for k in weights)


def _check_export(tmp_path: Path) -> None:
    """The consolidated export of the tensor-parallel model reloads on one process: its weights, its logits."""
    from transformers import LlamaForCausalLM

    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    model = LlamaForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=probe()).logits
    assert (logits - torch.load(tmp_path / "logits.pt")).abs().max().item() <= 1e-5
    _, exported = _run(tmp_path, "tp_reference")
    assert all(torch.equal(model.state_dict()[k], exported[k]) for k in exported)


def test_tensor_parallel_checkpoint_resumes_on_its_mesh_one_process_and_fsdp2(tmp_path: Path) -> None:
    run_ranks(JOB, 2, str(tmp_path), "float32", "tp", "fsdp")
    resumed(tmp_path, "tp_to_one", "one", torch.float32, "tp_ckpt")  # this process, with no process group

    same_losses, same_weights = _run(tmp_path, "tp_same")
    ref_losses, ref_weights = _run(tmp_path, "tp_reference")
    assert same_losses == ref_losses[-len(same_losses) :]
    assert all(torch.equal(same_weights[k], ref_weights[k]) for k in ref_weights)

    for run in ("tp_to_one", "tp_to_fsdp"):
        loss, weight = _differences(tmp_path, run, "tp_reference")
        assert loss <= ACROSS and weight <= ACROSS, (run, loss, weight)

    _, forgot = _differences(tmp_path, "tp_model_only", "tp_reference")
    assert forgot > 1e-3, forgot  # without the optimizer state the run goes elsewhere
    _check_export(tmp_path)


def test_one_process_checkpoint_resumes_tensor_parallel(tmp_path: Path) -> None:
    before = set(os.environ)
    one_process(tmp_path, torch.float32)
    _drop_added(before)  # before the ranks start, so they fork from the warm server
    run_ranks(JOB, 2, str(tmp_path), "float32", "from_one")
    loss, weight = _differences(tmp_path, "one_to_tp", "one_reference")
    assert loss <= ACROSS and weight <= ACROSS, (loss, weight)


def test_missing_optimizer_or_model_is_refused_in_one_line(tmp_path: Path) -> None:
    model, optimizer = build("one", torch.float32)
    save_sharded(model, None, tmp_path / "weights_only")
    with pytest.raises(ConfigError, match=r"holds the model but not the optimizer .* pass optimizer=None") as info:
        load_sharded(model, optimizer, tmp_path / "weights_only")
    assert "\n" not in str(info.value)
    load_sharded(model, None, tmp_path / "weights_only")
    with pytest.raises(ConfigError, match="holds no sharded model checkpoint"):
        load_sharded(model, optimizer, tmp_path / "nothing")
