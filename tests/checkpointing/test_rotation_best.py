"""``save_total_limit=1`` with ``load_best_model_at_end``: at the end only the best checkpoint is left, as stock.

transformers' end of training (``_finalize_training``) deletes every checkpoint but the best when the limit is 1;
during training its rotation keeps the newest and the best. Ours rotates after every rank has committed the save,
and leaves the same folders at each point, on 1 process and on 2 gloo ranks. A preempted run has not ended: its
last checkpoint stays. tests/parity/test_best_checkpoint_rotation.py runs the same job under the stock Trainer.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.checkpointing.best_limit_job import run
from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.timeout(300)

# what transformers documents and does (5.17 to 5.24): the newest and the best kept after each save, the best alone
# from the end of training on (before on_train_end); callbacks read the user's limit
EXPECTED = {
    "saves": [["checkpoint-2"], ["checkpoint-2", "checkpoint-4"], ["checkpoint-2", "checkpoint-6"]]
    + [["checkpoint-2", "checkpoint-8"]],
    "limits": [1, 1, 1, 1],
    "at_train_end": ["checkpoint-2"],
    "best": "checkpoint-2",
    "ended": "finished",
    "limit_after": 1,
}


def test_limit_1_leaves_only_the_best_checkpoint(tmp_path: Path) -> None:
    result = run(tmp_path, "ours")
    assert result == EXPECTED
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


@pytest.mark.distributed
def test_limit_1_leaves_only_the_best_checkpoint_on_two_ranks(tmp_path: Path) -> None:
    run_ranks("tests.checkpointing.best_limit_job", 2, str(tmp_path), "ours")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result.pop("left") == ["checkpoint-2"]
    assert result == EXPECTED


def test_a_preempted_run_keeps_its_last_checkpoint(tmp_path: Path) -> None:
    """SIGUSR1 in step 5: checkpoint-5 is saved and stays beside the best (the run resumes from it)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        result = run(tmp_path, "ours", preempt=True)
    finally:  # after a preemption the handlers stay, so a second signal cannot kill the exiting process
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert result["ended"] == "exit 75"
    assert result["best"] == "checkpoint-2"
    assert result["at_train_end"] == ["checkpoint-2", "checkpoint-5"]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-5"]
    assert result["limit_after"] == 1  # the user's arguments as they gave them
