"""``save_total_limit=1`` with ``load_best_model_at_end`` under the stock Trainer and ours: the same folders left.

The job (``tests.checkpointing.best_limit_job``) saves every 2 steps with the oldest checkpoint the best; stock
(transformers + accelerate) and ours run it on 1 process and on 2 gloo ranks, and observe the same folders after
each save, at ``on_train_end`` and at the end. Needs accelerate for the stock side (see tests/parity/README.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpointing.test_rotation_best import EXPECTED
from tests.helpers.ranks import child_env, run_ranks

pytest.importorskip("accelerate")

pytestmark = [pytest.mark.parity, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def _job(out: Path, impl: str, nproc: int) -> dict:
    if nproc > 1:
        run_ranks("tests.checkpointing.best_limit_job", nproc, str(out), impl)
    else:  # one plain process, as `python script.py`
        command = [sys.executable, "-m", "tests.checkpointing.best_limit_job", str(out), impl]
        env = {**child_env(), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("nproc", [1, 2])
def test_stock_and_ours_leave_the_same_checkpoints(tmp_path: Path, nproc: int) -> None:
    stock = _job(tmp_path / "stock", "stock", nproc)
    ours = _job(tmp_path / "ours", "ours", nproc)
    assert ours == stock
    assert stock == {**EXPECTED, "left": ["checkpoint-2"]}
    assert os.listdir(tmp_path / "ours") and sorted(os.listdir(tmp_path / "ours")) == sorted(
        os.listdir(tmp_path / "stock")
    )
