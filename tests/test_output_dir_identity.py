"""The job recorded in ``trainer_ext_run.json`` names the shipped data, not where the package is installed: a run
recorded by an install in one place is the same job for an install in another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainer_ext.errors import ConfigError
from trainer_ext.job import output_dir
from trainer_ext.job.arguments import TrainJobArguments
from trainer_ext.job.builtin_data import CORPUS, SENTIMENT

OTHER_INSTALL = "/opt/elsewhere/lib/python3.12/site-packages/trainer_ext/job/builtin_data/sentiment.jsonl"


def recorded(out: Path, job: dict) -> None:
    """A previous run in ``out``: its record and one checkpoint."""
    (out / "checkpoint-4").mkdir(parents=True)
    (out / output_dir.RUN_FILE).write_text(json.dumps({"trainer_ext_run": 1, "job": job}))


def test_the_shipped_data_is_recorded_by_name(tmp_path: Path) -> None:
    builtin = output_dir.job_identity(TrainJobArguments(output_dir=str(tmp_path)))
    assert builtin["train_file"] == "<built-in sentiment.jsonl>" and str(SENTIMENT.parent) not in json.dumps(builtin)
    causal = output_dir.job_identity(TrainJobArguments(output_dir=str(tmp_path), task="causal-lm"))
    assert causal["train_file"] == "<built-in corpus.jsonl>"
    mine = tmp_path / "sentiment.jsonl"  # a copy of the data elsewhere is the user's own file, named by its path
    shutil.copy(SENTIMENT, mine)
    own = output_dir.job_identity(TrainJobArguments(output_dir=str(tmp_path), train_file=str(mine)))
    assert own["train_file"] == str(mine)


@pytest.mark.parametrize(
    "where",
    [OTHER_INSTALL, "<built-in sentiment.jsonl>", str(SENTIMENT)],
    ids=["another-install", "by-name", "this-install"],
)
def test_a_run_recorded_by_another_install_is_resumed(tmp_path: Path, where: str) -> None:
    out = tmp_path / "out"
    job = {**TrainJobArguments(output_dir=str(out)).fingerprint(), "train_file": where}
    recorded(out, job)
    resume = TrainJobArguments(output_dir=str(out), resume_from_checkpoint="true")
    assert output_dir.check(resume) is True
    with pytest.raises(
        ConfigError, match="holds checkpoints of this job"
    ):  # the same job: asked to decide, not refused
        output_dir.check(TrainJobArguments(output_dir=str(out)))


def test_other_data_is_still_another_job(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = {**TrainJobArguments(output_dir=str(out)).fingerprint(), "train_file": OTHER_INSTALL}
    recorded(out, job)
    causal = TrainJobArguments(output_dir=str(out), task="causal-lm", resume_from_checkpoint="true")
    with pytest.raises(ConfigError, match=r"different job \(task: .*train_file: '<built-in sentiment\.jsonl>' -> "):
        output_dir.check(causal)
    assert output_dir.shipped_name(str(CORPUS)) == "<built-in corpus.jsonl>"
    assert output_dir.shipped_name("/data/trainer_ext/other.jsonl") is None and output_dir.shipped_name(None) is None
