"""accelerate.utils' helpers that scripts import beside ``Accelerator``, and ``print(accelerator.state)``: ours answer
as accelerate 1.15 does.

Every ``is_*_available`` (and ``is_torch_version``) trainer_ext exports gives accelerate's answer on this machine,
with the arguments accelerate takes; ``str(accelerator.state)`` and the process state's text read as accelerate's
on 1 and 2 processes; ``gather_object`` gathers the same. Needs accelerate (the side environment, README.md):
skipped without it unless ``TRAINER_EXT_REQUIRE_ACCELERATE=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ranks import child_env

REQUIRED = os.environ.get("TRAINER_EXT_REQUIRE_ACCELERATE") == "1"

try:
    import accelerate.utils as stock_utils
except ImportError as exc:
    if REQUIRED:
        raise RuntimeError(f"TRAINER_EXT_REQUIRE_ACCELERATE=1 but accelerate does not import ({exc})") from exc
    stock_utils = None

pytestmark = [
    pytest.mark.parity,
    pytest.mark.skipif(
        stock_utils is None, reason="the stock side needs accelerate (tests/accelerator_parity/README.md)"
    ),
]

# the arguments each check takes besides its defaults, tried too
VARIANTS: dict[str, list[tuple]] = {
    "is_torch_version": [(op, v) for op in (">", ">=", "==", "!=", "<=", "<") for v in ("2.4", "2.13.0", "3.0")],
    "is_bnb_available": [("0.1",), ("99.0",)],
    "is_mps_available": [("2.0",), ("99.0",)],
    "is_bf16_available": [(True,)],
    "is_torch_xla_available": [(True, False), (False, True)],
    "is_xpu_available": [(True,)],
    "is_npu_available": [(True,)],
    "is_mlu_available": [(True,)],
    "is_musa_available": [(True,)],
    "is_sdaa_available": [(True,)],
    "is_neuron_available": [(True,)],
    "is_hpu_available": [(True,)],
}
# the only lines of the state's text that may differ, stock -> ours: a CPU process's device is plain ``cpu`` in a
# process group (accelerate: ``cpu:0``), as transformers' Trainer needs (docs/accelerator.md, Members)
ALLOWED_LINES = {("Device: cpu:0", "Device: cpu")}


def _exported() -> list[str]:
    import trainer_ext.accelerator.availability as ours

    return list(ours.__all__)


@pytest.mark.parametrize("name", _exported())
def test_each_check_answers_as_accelerate(name: str) -> None:
    import trainer_ext

    ours, stock = getattr(trainer_ext, name), getattr(stock_utils, name)
    calls = [()] if name != "is_torch_version" else []
    for args in calls + VARIANTS.get(name, []):
        got, expected = ours(*args), stock(*args)
        assert isinstance(got, bool), f"{name}{args} -> {got!r}: not a bool"
        assert got == bool(expected), f"{name}{args}: ours {got!r}, accelerate {expected!r}"


def test_every_check_of_ours_is_one_of_accelerates() -> None:
    missing = [name for name in _exported() if not hasattr(stock_utils, name)]
    assert not missing, f"not accelerate.utils names: {missing}"


def _run(impl: str, nproc: int, out: Path) -> list[dict]:
    env = child_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launch += [] if nproc == 1 else ["--nproc_per_node", str(nproc)]
    cmd = [*launch, "-m", "tests.accelerator_parity.state_text_job", impl, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{impl} on {nproc}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-5000:]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def _differing_lines(stock: str, ours: str) -> set[tuple[str, str]]:
    a, b = stock.split("\n"), ours.split("\n")
    assert len(a) == len(b), f"line counts differ:\nstock:\n{stock}\nours:\n{ours}"
    return {(x, y) for x, y in zip(a, b, strict=True) if x != y}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [1, 2])
def test_state_text_and_gather_object_read_as_accelerates(nproc: int, tmp_path: Path) -> None:
    stock, ours = _run("stock", nproc, tmp_path / "stock"), _run("ours", nproc, tmp_path / "ours")
    for rank, (s, o) in enumerate(zip(stock, ours, strict=True)):
        assert not o["accelerate_imported"]
        assert o["gather_object"] == s["gather_object"], rank
        for key in ("accelerator_state", "process_state"):
            differing = _differing_lines(s[key], o[key])
            assert differing <= ALLOWED_LINES, f"rank {rank} {key}:\nstock:\n{s[key]}\nours:\n{o[key]}"
            if nproc == 1:
                assert s[key] == o[key]
        assert "Mixed precision type: bf16" in o["accelerator_state"]
        assert "Mixed precision type" not in o["process_state"]
