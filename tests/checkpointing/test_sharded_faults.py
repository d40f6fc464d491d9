"""Damaged FSDP2 checkpoints and mismatched DeepSpeed ones on 2 real gloo ranks (fault_jobs.py under torchrun)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.jobs import make_args
from tests.helpers.ranks import run_ranks
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.checkpointing import COMPLETE
from trainer_ext.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(400)]
JOB = "tests.checkpointing.fault_jobs"


def _run(out: Path, mode: str) -> list[dict]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run_ranks(JOB, 2, str(out), mode, timeout=360)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _run(tmp_path_factory.mktemp("fsdp_faults"), "fsdp")


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("truncate", "model_sharded/__1_0.distcp has"),
        ("same_size", "model_sharded/__1_0.distcp does not match its checksum"),
    ],
)
def test_a_damaged_fsdp_shard_makes_both_ranks_fall_back_and_say_why(
    fsdp_run: list[dict], how: str, reason: str
) -> None:
    for rank in fsdp_run:
        assert rank[how]["chosen"] == "checkpoint-2", rank[how]
        skipped = [line for line in rank[how]["warnings"] if "resume: skipping checkpoint-4" in line]
        assert len(skipped) == 1 and reason in skipped[0], rank[how]["warnings"]


def test_the_run_resumes_from_the_fallback_to_the_end(fsdp_run: list[dict]) -> None:
    assert [rank["resumed_steps"] for rank in fsdp_run] == [6, 6]


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("deepspeed_faults")
    return out, _run(out, "deepspeed")


@pytest.mark.deepspeed
def test_a_deepspeed_checkpoint_of_another_model_is_refused(deepspeed_run: tuple[Path, list[dict]]) -> None:
    _, ranks = deepspeed_run
    for rank in ranks:
        assert rank["refused"] is not None, "resuming another model from a DeepSpeed checkpoint must be refused"
        assert rank["refused"].startswith("checkpoint-2 holds another model: shapes differ: ")
        assert "model.layers.0.mlp.down_proj.weight [32, 64] vs [32, 80]" in rank["refused"]


@pytest.mark.deepspeed
def test_a_deepspeed_checkpoint_resumes_only_on_its_world_size(deepspeed_run: tuple[Path, list[dict]]) -> None:
    out, _ = deepspeed_run
    folder = out / "checkpoint-2"
    assert json.loads((folder / COMPLETE).read_text())["strategy"] == "deepspeed"
    one = Trainer(model=tiny_llama(0), args=make_args(out, per_device_train_batch_size=2), train_dataset=lm_dataset(4))
    with pytest.raises(ConfigError, match="DeepSpeed checkpoint of 2 processes and this run has 1: resume DeepSpeed"):
        one.resolve_resume(str(folder))
