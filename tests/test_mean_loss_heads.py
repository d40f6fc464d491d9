"""A head that accepts ``num_items_in_batch`` but returns a plain mean (BERT/GPT-2-era heads) trains and logs that
mean: 2 processes, with and without accumulation, equal 1 process (transformers' Trainer logs and trains on the
loss times processes x accumulation steps there, and reports eval_loss times the processes)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import mean_loss_job
from tests.helpers.jobs import max_abs_diff
from tests.helpers.ranks import run_ranks

NOTICE = "accepts num_items_in_batch but computes its loss as a per-micro-batch mean"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    found = {}
    for nproc in (1, 2):
        found[nproc] = tmp_path_factory.mktemp(f"mean_loss_{nproc}")
        run_ranks(mean_loss_job, nproc, str(found[nproc]))
    return found


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def test_the_head_is_one_transformers_would_scale() -> None:
    """Its forward takes ``**kwargs``, so transformers' Trainer would divide nothing and multiply by the world size."""
    parameters = inspect.signature(type(mean_loss_job.tiny_bert_classifier()).forward).parameters.values()
    assert any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)


@pytest.mark.distributed
@pytest.mark.parametrize("accumulation", [1, 2])
def test_two_processes_log_and_train_what_one_does(runs: dict[int, Path], accumulation: int) -> None:
    single, double = _results(runs[1])["1x1"], _results(runs[2])[f"2x{accumulation}"]
    assert single["accepts_loss_kwargs"] is double["accepts_loss_kwargs"] is False
    assert len(single["loss"]) == 4
    assert double["loss"] == pytest.approx(single["loss"], rel=1e-6)  # 2 (x 2) times larger under transformers
    assert double["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)  # what the clipping sees
    assert double["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-6)
    weights = load_file(runs[2] / f"2x{accumulation}.safetensors")
    assert max_abs_diff(weights, load_file(runs[1] / "1x1.safetensors")) < 1e-5  # fp32 sums in another order, Adam


@pytest.mark.distributed
def test_the_main_process_says_so_once_at_start_up(runs: dict[int, Path]) -> None:
    main, other = (json.loads((runs[2] / f"logs-{rank}.json").read_text()) for rank in (0, 1))
    assert [line for line in other["2x1"] + other["2x2"] if NOTICE in line] == []
    for key, factor in (("2x1", 2), ("2x2", 4)):
        notices = [line for line in main[key] if NOTICE in line]
        assert len(notices) == 1, main[key]
        assert f"{factor}x the training loss and its gradients, 2x eval_loss" in notices[0]
    single = json.loads((runs[1] / "logs-0.json").read_text())["1x1"]
    assert [line for line in single if NOTICE in line] == [
        f"BertForSequenceClassification {NOTICE}: trained and logged as that mean, equal to a 1-process run"
    ]
