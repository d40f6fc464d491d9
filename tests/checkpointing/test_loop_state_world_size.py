"""``Accelerator.load_state`` of a ``save_state`` written by another number of processes (world_size_job.py).

The global batch is the same on 1, 2 and 3 processes (per-device 2 x accumulation 6 / 3 / 2): a resumed run must
read the rest of the data the uninterrupted run reads, step by step, and end with its weights. fp32 on the CPU: the
averages over ranks and over micro-batches add in another order, so the weights agree within 1e-5 (measured
about 2e-7), not bitwise. DDP and single resume from whole files, FSDP2 through DCP resharding (its 1-process
resume here is a plain model loading the shards); DeepSpeed refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.checkpointing import world_size_job as job
from tests.helpers.ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]
JOB = job.__name__
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every run of the module: 1 process here, 2 and 3 under torchrun, each phase resuming the one before's saves."""
    out = tmp_path_factory.mktemp("world_size")
    job.run(out, "one_full")
    job.run(out, "one_saved", stop=True)
    run_ranks(JOB, 2, str(out), "two", timeout=300)
    job.run(out, "ddp_two_to_one", resume="ddp2_saved")
    job.run(out, "fsdp_two_to_one", resume="fsdp2_saved")
    job.run(out, "plain_two_to_one", resume="plain2_saved", shuffle="plain")
    job.stream(out, "stream_two_to_one", resume="stream2_saved")
    run_ranks(JOB, 3, str(out), "three", timeout=300)
    return out


def _max_diff(out: Path, a: str, b: str) -> float:
    first, second = load_file(str(out / f"{a}.safetensors")), load_file(str(out / f"{b}.safetensors"))
    assert first.keys() == second.keys()
    return max(float((first[k] - second[k]).abs().max()) for k in first)


def _record(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def test_the_references_agree_on_every_number_of_processes(runs: Path) -> None:
    """The premise: 1 process x accumulation 6 and 2 x 3 (DDP, FSDP2) read the same samples each step."""
    assert (
        _record(runs, "one_full")["steps"]
        == _record(runs, "ddp2_full")["steps"]
        == _record(runs, "fsdp2_full")["steps"]
    )
    assert _max_diff(runs, "one_full", "ddp2_full") < TOLERANCE
    assert _max_diff(runs, "fsdp2_full", "ddp2_full") < TOLERANCE


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


@pytest.mark.parametrize(
    ("resumed", "reference", "saved", "saved_by", "processes"),
    [
        ("ddp_two_to_one", "ddp2_full", "ddp2_saved", 2, 1),
        ("one_to_two", "one_full", "one_saved", 1, 2),
        ("ddp_two_to_three", "ddp2_full", "ddp2_saved", 2, 3),
        ("fsdp_two_to_one", "fsdp2_full", "fsdp2_saved", 2, 1),
        ("fsdp_one_to_two", "one_full", "one_saved", 1, 2),
        ("fsdp_two_to_three", "fsdp2_full", "fsdp2_saved", 2, 3),
    ],
)
def test_a_run_resumed_on_another_number_of_processes_continues_the_uninterrupted_one(
    runs: Path, resumed: str, reference: str, saved: str, saved_by: int, processes: int
) -> None:
    """Saved after optimizer step 3 of 8 (mid-epoch): the 5 steps left read the same samples, end on its weights."""
    record, full = _record(runs, resumed), _record(runs, reference)["steps"]
    assert len(record["steps"]) == 5 and record["steps"] == full[3:], (
        "the data position or the accumulation window did not carry over"
    )
    assert _max_diff(runs, resumed, reference) < TOLERANCE
    log = record["log"]
    assert f"was saved by {_processes(saved_by)}, this run has {processes}: " in log[0][0]
    for rank, lines in enumerate(log):
        keeps_own = [line for line in lines if "holds no random state" in line]
        # accelerate's behaviour: a process the checkpoint did not have keeps its own random state, and says so
        expected = f"WARNING: load_state: {runs / saved} holds no random state for process {rank} (saved by "
        expected += f"{_processes(saved_by)}); it keeps its own"
        assert keeps_own == ([] if rank < saved_by else [expected]), lines


def test_a_plain_shuffled_loader_resumes_its_epoch_in_the_same_order_on_one_process(runs: Path) -> None:
    """A plain shuffle=True sampler orders a pass by a generator on several processes and by a seed drawn per pass
    on one (accelerate's behaviour): the pass's saved generator state is lent to the one-process sampler."""
    resumed, full = _record(runs, "plain_two_to_one")["steps"], _record(runs, "plain2_full")["steps"]
    assert resumed[0] == full[3], "the rest of the epoch being read must be the samples the 2-process run read"


def test_a_stream_position_is_not_translated_but_its_epoch_restarts_with_a_warning(runs: Path) -> None:
    """A stream counts batches per process: on another number it reads the saved epoch again, and says so once."""
    record = _record(runs, "stream_two_to_one")
    assert record["first"] == [0, 1]
    lines = [line for line in record["log"][0] if "cannot translate" in line]
    assert lines == [
        "WARNING: load_state: dataloader 0 was 3 batches per process into epoch 0 on 2 processes, a position it "
        "cannot translate to 1: it reads that epoch from its beginning (accelerator.skip_first_batches skips what "
        "was already seen)"
    ]


@pytest.mark.deepspeed
def test_deepspeed_refuses_a_checkpoint_of_another_number_of_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its engine checkpoint (ZeRO partitions per rank) loads only on the number of processes that wrote it."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_ranks(JOB, 2, str(tmp_path), "deepspeed_save", timeout=300)
    run_ranks(JOB, 1, str(tmp_path), "deepspeed_load", timeout=300)
    refused = _record(tmp_path, "ds_refused")["refused"]
    assert refused == (
        f"ConfigError: {str(tmp_path / 'ds2_saved')!r} was saved by 2 processes but this run has 1, and DeepSpeed "
        "checkpoints load only on the number of processes that wrote them; resume with 2 processes"
    )
