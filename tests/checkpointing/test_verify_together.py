"""On 2 real gloo ranks, a failure no check foresaw on one rank is shared: no rank waits alone, all skip it."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer_ext.checkpointing import CheckpointError, write_marker
from trainer_ext.checkpointing.together import verify_together

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _rank(rank: int, folder: str) -> None:
    root = Path(folder)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        verify_together(root / "checkpoint-2", part=(rank, 2))
        outcome = "accepted"
    except CheckpointError as error:
        outcome = f"refused: {error}"
    (root / f"rank{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


def test_an_unforeseen_error_on_one_rank_is_shared(tmp_path: Path) -> None:
    """Rank 0 fails a checksum; rank 1 (other checksums) meets a RecursionError in a JSON file: both refuse."""
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    (folder / "a.txt").write_text("aaaa")
    (folder / "b.txt").write_text("bbbb")
    (folder / "nested.json").write_text("[" * 100_000 + "]" * 100_000)
    write_marker(folder, world_size=2, step=2)
    (folder / "a.txt").write_text("AAAA")  # same size: only rank 0's checksum tells

    mp.spawn(_rank, args=(str(tmp_path),), nprocs=2, join=True)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith("refused: a.txt does not match its checksum"), outcomes
