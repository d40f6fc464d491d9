"""accelerate's resume pattern and ours give the uninterrupted run's batches, LRs and weights (1 and 2 processes).

accelerate's examples call ``load_state`` and then ``skip_first_batches`` for the resumed epoch; trainer_ext's
``load_state`` already restores each loader's position, so the skip must replace it (once, not twice), and must
not outlive the resumed epoch. The order of a plain shuffled loader (no seedable sampler, accelerate's default)
must come back too: the resumed epoch reads the same permutation as the interrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import resume_loops
from tests.helpers.ranks import run_ranks

STOP = 20  # of 50 batches per epoch on one process, 25 on two


def _resumed(full: dict, resumed: dict, stop: int) -> None:
    """The resumed run continues the uninterrupted one exactly from step ``stop``."""
    steps = [batch for epoch in sorted(full["seen"], key=int) for batch in full["seen"][epoch]]
    again = [batch for epoch in sorted(resumed["seen"], key=int) for batch in resumed["seen"][epoch]]
    assert again == steps[stop:]
    assert resumed["lrs"] == full["lrs"][stop:]
    assert resumed["weights"] == full["weights"]  # bitwise: same batches, same order of operations


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("resume1")
    results = {"full": resume_loops.run(out)}
    resume_loops.run(out, stop_at=STOP)
    results["accelerate"] = resume_loops.run(out, resume="accelerate")
    results["ours"] = resume_loops.run(out, resume="ours")
    return json.loads(json.dumps(results))  # the same JSON keys as the multi-rank results


@pytest.mark.parametrize("style", ["accelerate", "ours"])
def test_one_process_resume_continues_the_uninterrupted_run(one_process: dict, style: str) -> None:
    _resumed(one_process["full"], one_process[style], STOP)
    # the figures: 50 batches per epoch, resumed at step 20 -> 30 in the resumed epoch, 50 in the next
    assert one_process[style]["batches_per_epoch"] == {"0": 30, "1": 50}
    assert one_process["full"]["lrs"][-1] == 0.0  # the schedule ends on time


def test_the_shuffle_differs_between_epochs_and_from_the_identity(one_process: dict) -> None:
    seen = one_process["full"]["seen"]
    first, second = ([i for batch in seen[e] for i in batch] for e in ("0", "1"))
    assert sorted(first) == sorted(second) == list(range(resume_loops.SAMPLES))
    assert first != second and first != list(range(resume_loops.SAMPLES))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_resume_in_both_styles(tmp_path: Path) -> None:
    run_ranks("tests.helpers.resume_loops", 2, str(tmp_path), timeout=300)
    per_rank = json.loads((tmp_path / "results.json").read_text())
    for rank in per_rank:
        for style in ("accelerate", "ours"):
            _resumed(rank["full"], rank[style], STOP)
            assert rank[style]["batches_per_epoch"] == {"0": 5, "1": 25}  # the figures on two processes
        assert rank["full"]["lrs"][-1] == 0.0  # accelerate's rule: the scheduler advances once per process per step
    # the ranks read different halves of one permutation
    ids = [set(i for batch in rank["full"]["seen"]["0"] for i in batch) for rank in per_rank]
    assert not ids[0] & ids[1] and len(ids[0] | ids[1]) == resume_loops.SAMPLES
