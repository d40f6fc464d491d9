"""load_state + skip_first_batches skips once on every loader kind (map-style, iterable, dispatched; 1 and 2 ranks).

Loaders that resume by reading (iterable, dispatched) used to skip twice: the position restored by ``load_state``
and then ``skip_first_batches`` on top. No skip may outlive the resumed epoch either.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.ranks import run_ranks


def _check(result: dict) -> None:
    for kind, got in result.items():
        assert got["load_and_skip"] == got["rest"], kind
        assert got["load_alone"] == got["rest"], kind
        assert got["after_skip"] == got["next_epoch"], kind  # the skip ends with its epoch
        assert got["after_alone"] == got["next_epoch"], kind


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_styles_skip_once_on_every_loader_kind(tmp_path: Path, nproc: int) -> None:
    run_ranks("tests.helpers.skip_resume_job", nproc, str(tmp_path), timeout=300)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    for result in results:
        assert set(result) == ({"map", "iterable", "dispatch"} if nproc == 2 else {"map", "iterable"})
        _check(result)
