"""A TRL config built as TRL's parser builds it (stock first), then re-based on ours, on 2 launched gloo ranks.

Without ``--use_cpu`` on a CPU launch, transformers' set-up (accelerate underneath) starts the process group yet
leaves the stock config NOT_DISTRIBUTED and warns "process group is initialized, but parallel_mode !=
ParallelMode.DISTRIBUTED ... launch with torch.distributed.launch"; the re-based arguments then run the group as
DDP, so with trainer_ext imported (``from trainer_ext import adapt``) that warning is not shown.

    python -m tests.with_trl.test_trl_group_warning OUT    (one rank: torchrun's variables)
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

LOGGERS = ("transformers.training_args", "trainer_ext.trainer.training_args")


class _Kept(logging.Handler):
    """The records that passed the loggers' filters."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_stock_trl_config_then_ours_on_two_ranks_logs_no_group_warning(tmp_path: Path) -> None:
    from tests.helpers.ranks import run_ranks

    run_ranks("tests.with_trl.test_trl_group_warning", 2, str(tmp_path))
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # the condition in which transformers' set-up warns: a group, and the stock config not DISTRIBUTED
        assert facts["stock"] == {"group": True, "parallel_mode": "not_parallel"}
        assert facts["ours"] == {"parallel_mode": "distributed", "world_size": 2, "process_index": rank}
        assert facts["messages"] == []


def main(out: str) -> None:
    """One rank: ``from trainer_ext import adapt`` first (as a script does), then TRL's stock config, then ours."""
    import torch.distributed as dist
    import trl

    from trainer_ext import adapt  # noqa: F401  (what an adapted script imports before parsing its arguments)
    from trainer_ext.distributed.state import destroy_process_group
    from trainer_ext.trainer.adapt import rebase_arguments

    kept = _Kept()
    for name in LOGGERS:
        logging.getLogger(name).addHandler(kept)
    stock = trl.SFTConfig(output_dir=str(Path(out, "run")), report_to="none", bf16=False)  # TRL defaults to bf16
    facts = {"stock": {"group": dist.is_initialized(), "parallel_mode": stock.parallel_mode.value}}
    ours = rebase_arguments(stock)
    facts["ours"] = {
        "parallel_mode": ours.parallel_mode.value,
        "world_size": ours.world_size,
        "process_index": ours.process_index,
    }
    facts["messages"] = kept.messages
    Path(out, f"rank{ours.process_index}.json").write_text(json.dumps(facts))
    destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
