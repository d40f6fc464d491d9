"""What context parallelism refuses, in one ``ConfigError`` line: on 2 real gloo ranks (one launch of
:mod:`tests.distributed.cp_loop_job`), a sliding-window model given to the Trainer or to ``Accelerator.prepare``
before any step, a sequence that does not split into ``2 × cp`` chunks and ``position_ids`` left out of the buffers
in ``maybe_context_parallel`` (while the Trainer pads odd lengths itself); in this process, before any process
group, DeepSpeed with ``cp_size > 1`` through the Accelerator (``TrainingArguments`` and a forced ``torch`` backend
on CPU: tests/distributed/test_nd_refusals.py)."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from tests.distributed.nd_runs import seen
from tests.distributed.test_nd_refusals import DEEPSPEED, _world, refused, world  # noqa: F401  (_world: fixture)
from tests.helpers.ranks import run_ranks
from trainer_ext import Accelerator, DeepSpeedPlugin, ParallelismConfig

SLIDING = (
    "cp_size=2: mistral uses sliding-window attention (8 tokens), which context parallelism cannot express; train it "
    "with cp_size=1 (use dp_shard_size or tp_size)"
)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("cp_refusals")
    run_ranks("tests.distributed.cp_loop_job", 2, str(out), "2,1", "refusals", timeout=600)
    return seen(out, "refusals")


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_sliding_window_model_is_refused_before_the_first_step(refusals: dict) -> None:
    assert refusals["trainer"] == SLIDING and refusals["trainer_steps"] == 0
    assert refusals["prepare"] == SLIDING


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_length_that_does_not_split_is_refused_in_the_region_and_padded_by_the_trainer(refusals: dict) -> None:
    assert refusals["length"] == (
        "context parallelism splits each sequence into 4 equal chunks, and this batch has 6 positions: pad the batch "
        "to a multiple of 4 (pad_to_multiple_of=4 in the data collator)"
    )
    assert refusals["odd_steps"] == 2 and len(refusals["odd_losses"]) == 2
    assert all(math.isfinite(loss) and 3 < loss < 6 for loss in refusals["odd_losses"]), refusals["odd_losses"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_position_ids_left_out_of_the_buffers_are_refused(refusals: dict) -> None:
    assert refusals["positions"] == (
        "context parallelism needs position_ids among the sharded buffers (global positions for the rotary "
        "embeddings): pass position_ids to the model and to maybe_context_parallel's buffers"
    )


def test_deepspeed_with_context_parallelism_through_the_accelerator(monkeypatch) -> None:
    world(monkeypatch, 2)
    cp2 = ParallelismConfig(cp_size=2)
    for settings in (dict(deepspeed_config=DEEPSPEED), dict(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=DEEPSPEED))):
        message = refused(lambda s=settings: Accelerator(cpu=True, parallelism_config=cp2, **s), "DeepSpeed")
        assert "cp_size=2" in message and "FSDP2" in message, message
    assert not dist.is_initialized()
