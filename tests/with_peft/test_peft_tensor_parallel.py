"""LoRA under tensor parallelism (2 gloo ranks, tp_size 2) against one process: the adapter factors on the split
side of each planned layer are sharded with it, the others replicated; losses, grad norms and the saved adapter
after 10 steps (accumulation 2, clipping) equal one process's within 1e-5 (measured ~3e-7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from tests.helpers.ranks import run_ranks  # noqa: E402
from tests.with_peft.peft_tp_job import STEPS, tp_lora_job  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
PARITY = 1e-5


def test_lora_with_tensor_parallelism_matches_one_process(tmp_path: Path) -> None:
    reference = tp_lora_job(tmp_path / "one")
    run_ranks("tests.with_peft.peft_tp_job", 2, str(tmp_path / "tp"))
    seen = json.loads((tmp_path / "tp" / "result.json").read_text())
    assert len(seen["losses"]) == STEPS and seen["dtensors"] > 0
    for key in ("losses", "norms"):
        assert max(abs(a - b) for a, b in zip(seen[key], reference[key], strict=True)) <= PARITY, key
    ours = load_file(tmp_path / "tp" / "final" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "one" / "final" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and len(ours) == 16
    moved = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    assert moved <= PARITY, moved
