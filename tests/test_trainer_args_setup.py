"""Device set-up of our TrainingArguments in a process group that exists before them, on 2 real gloo ranks.

TRL's parser builds its stock config first; with accelerate installed, transformers' set-up starts the process group
(no backend named) and, on a CPU launch without ``--use_cpu``, warns "process group is initialized, but parallel_mode
!= ParallelMode.DISTRIBUTED". Our arguments, built next, run that group as one DDP job, so the warning misleads:
ours drops it there, and warns (transformers' and our own words) where a group exists that ours does not train in.
This environment has no accelerate, so stock's set-up cannot run here: its warning is sent through transformers'
own logger with transformers' own text (read from its source); tests/with_trl runs the real stock set-up first.

``accelerator_config={"use_configured_state": True}`` asks for a state set up before the arguments: refused as
transformers refuses it when there is none, taken (the arguments join the group) after our Accelerator started one.

    python -m tests.test_trainer_args_setup OUT [stock_first|configured]    (one rank: torchrun's variables)
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import pickle
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from tests.helpers.ranks import run_ranks
from trainer_ext import TrainingArguments
from trainer_ext.distributed.state import destroy_process_group
from trainer_ext.trainer.training_args import STOCK_GROUP_WARNING

LOGGERS = ("transformers.training_args", "trainer_ext.trainer.training_args")


def stock_warning_text() -> str:
    """transformers' own warning, as ``TrainingArguments._setup_devices`` logs it (one string constant)."""
    source = textwrap.dedent(inspect.getsource(transformers.TrainingArguments._setup_devices.func))
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(STOCK_GROUP_WARNING)
        ):
            return node.value
    raise AssertionError(
        f"transformers' _setup_devices no longer logs {STOCK_GROUP_WARNING!r}: update STOCK_GROUP_WARNING in "
        "trainer_ext/trainer/training_args.py (the filter that drops it where our engine runs the group)"
    )


class _Kept(logging.Handler):
    """The records that passed the loggers' filters."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _observe(out: Path, rank: int) -> None:
    """Stock's warning, then our arguments, in the group that exists: what was logged and how ours set up."""
    kept = _Kept()
    for name in LOGGERS:
        logging.getLogger(name).addHandler(kept)
    logging.getLogger("transformers.training_args").warning(stock_warning_text())  # stock's set-up, before ours
    args = TrainingArguments(output_dir=str(out / "run"), report_to="none")
    facts = {"messages": kept.messages, "parallel_mode": args.parallel_mode.value, "world_size": args.world_size}
    (out / f"rank{rank}.json").write_text(json.dumps(facts))


def _unlaunched_rank(rank: int, folder: str) -> None:
    """A group made by hand (spawn, a file store) in processes no launcher started: no RANK, no WORLD_SIZE."""
    root = Path(folder)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        _observe(root, rank)
    finally:
        dist.destroy_process_group()


def _results(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_the_stock_warning_is_the_one_we_filter() -> None:
    """transformers still logs the text our filter matches (else the filter silently stops working)."""
    assert stock_warning_text().startswith(STOCK_GROUP_WARNING)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_launched_group_started_before_ours_is_run_without_the_warning(tmp_path: Path) -> None:
    """Launched on 2 ranks, the group started with no backend named (as accelerate starts it for stock arguments):
    ours run it distributed, and neither transformers' warning nor one of ours is logged."""
    run_ranks("tests.test_trainer_args_setup", 2, str(tmp_path))
    for facts in _results(tmp_path):
        assert facts == {"messages": [], "parallel_mode": "distributed", "world_size": 2}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_group_this_process_was_not_launched_in_still_warns(tmp_path: Path) -> None:
    """A group of 2 made by hand without launcher variables: ours train each process alone, so transformers' warning
    stays and ours says what to do."""
    mp.spawn(_unlaunched_rank, args=(str(tmp_path),), nprocs=2, join=True)
    for facts in _results(tmp_path):
        assert facts["parallel_mode"] == "not_parallel" and facts["world_size"] == 1
        stock, ours = facts["messages"]
        assert stock == stock_warning_text()
        assert ours.startswith("a torch.distributed process group of 2 processes exists, but the launcher's variables")
        assert "trainer-ext launch --num_processes 2" in ours


CONFIGURED = {"use_configured_state": True}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_use_configured_state_takes_the_group_our_accelerator_started(tmp_path: Path) -> None:
    """On 2 launched ranks, trainer_ext.Accelerator() first: the arguments take its process group (DISTRIBUTED, 2
    processes), and consume the flag as transformers does, so a saved copy loads in a process with no state."""
    run_ranks("tests.test_trainer_args_setup", 2, str(tmp_path), "configured")
    for rank, facts in enumerate(_results(tmp_path)):
        assert facts == {"parallel_mode": "distributed", "world_size": 2, "process_index": rank, "flag": False}
    loaded = pickle.loads((tmp_path / "args.pkl").read_bytes())  # as training_args.bin is read elsewhere
    assert loaded.world_size == 1 and loaded.accelerator_config.use_configured_state is False


@pytest.mark.parametrize(
    "config",
    [CONFIGURED, json.dumps(CONFIGURED), transformers.trainer_pt_utils.AcceleratorConfig(**CONFIGURED)],
    ids=["dict", "json", "AcceleratorConfig"],
)
def test_use_configured_state_with_nothing_configured_is_refused(tmp_path: Path, config) -> None:
    """As transformers refuses it (ValueError) when no accelerate state was set up: here no process group either."""
    with pytest.raises(ValueError, match=r"^accelerator_config use_configured_state=True needs a distributed state"):
        TrainingArguments(output_dir=str(tmp_path), report_to="none", accelerator_config=config)


def _configured(out: Path) -> None:
    """Our Accelerator sets the state up, then the arguments ask for it."""
    from trainer_ext import Accelerator

    accelerator = Accelerator()
    args = TrainingArguments(output_dir=str(out / "run"), report_to="none", accelerator_config=CONFIGURED)
    facts = {
        "parallel_mode": args.parallel_mode.value,
        "world_size": args.world_size,
        "process_index": args.process_index,
        "flag": args.accelerator_config.use_configured_state,
    }
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(facts))
    if accelerator.is_main_process:
        (out / "args.pkl").write_bytes(pickle.dumps(args))
    accelerator.wait_for_everyone()


def main(out: str, mode: str = "stock_first") -> None:
    """One rank: the group as accelerate starts it for stock arguments, then ours; or our Accelerator's, then ours."""
    if mode == "configured":
        _configured(Path(out))
        return
    dist.init_process_group()  # env:// from torchrun's variables, no backend named
    try:
        _observe(Path(out), dist.get_rank())
    finally:
        destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
