"""The corruption matrix: every file kind of a checkpoint x every damage never gets the damaged checkpoint resumed.

For each case (corruption_jobs.py), ``checkpoint-2`` and ``checkpoint-4`` of a real run are copied and one file of
``checkpoint-4`` is damaged (or one of its folders, or the checkpoint folder itself, replaced by a link): ``resolve_resume(True)`` must fall back to ``checkpoint-2`` and log why, and
``resolve_resume(<checkpoint-4>)`` must refuse it with a ConfigError; both reasons name the damaged file.
One-process kinds (marker, weights, optimizer, scheduler, RNG, trainer state) run here; FSDP2's DCP shards and
DeepSpeed ZeRO-3's files come from one 2-rank run each, resolved by Trainers on both ranks, then re-checked here with
``marker.verify`` / ``newest_complete`` on one process (a one-process Trainer cannot resume a 2-rank DeepSpeed
checkpoint). Print the matrix as a table: ``python -m tests.checkpointing.corruption_jobs --table``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.checkpointing import corruption_jobs as jobs
from tests.helpers.ranks import run_ranks
from trainer_ext.checkpointing import CheckpointError, newest_complete, verify

pytestmark = pytest.mark.timeout(300)

# What a reason says instead of the file's name: the file that makes a folder a Trainer checkpoint is the weights'
# entry (DCP's .metadata, DeepSpeed's latest); without it the checkpoint "is missing the model's weights".
SAID_AS = {
    ("model_sharded/.metadata", "delete"): "the model's weights",
    ("latest", "delete"): "the model's weights",
    (".", "folder symlink"): f"{jobs.DAMAGED} is itself a symbolic link",
}


def _params(strategy: str, marks: dict[tuple[str, str], pytest.MarkDecorator] | None = None) -> list[Any]:
    return [
        pytest.param(kind, name, how, id=jobs.case_id(name, how), marks=(marks or {}).get((name, how), ()))
        for kind, name, how in jobs.cases(strategy)
        if how != "intact"
    ]


def _named(reason: str, name: str, how: str) -> bool:
    """Whether ``reason`` names the file (its name, without its folder at least), or says what it is instead."""
    return SAID_AS.get((name, how), Path(name).name) in reason


def _falls_back(result: dict[str, Any], name: str, how: str, logged: bool = True) -> None:
    assert result["auto_error"] is None, result
    assert result["auto"] == jobs.PREVIOUS, f"auto-resume took {result['auto']} after {how} of {name}"
    if logged:
        assert len(result["skipped"]) == 1, result["skipped"]
        assert result["skipped"][0].startswith(f"resume: skipping {jobs.DAMAGED}: "), result["skipped"]


def _refused(result: dict[str, Any], folder: Path) -> None:
    assert result["path"] is None, f"resume_from_checkpoint={folder} resumed from {result['path']}"
    assert result["refused"] is not None
    assert result["refused"].startswith(f"refusing to resume from {str(folder / jobs.DAMAGED)!r}: "), result


# ----------------------------------------------------------------------------------------------- one process


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoint-2 and checkpoint-4 of a real one-process run, built once."""
    return jobs.train(tmp_path_factory.mktemp("single_run"), "single")


@pytest.fixture(scope="module")
def single(single_run: Path, tmp_path_factory: pytest.TempPathFactory):
    """``(name, how) -> (folder, outcome)``: the case's copied, damaged output folder and what resume did there."""
    done: dict[tuple[str, str], tuple[Path, dict[str, Any]]] = {}
    root = tmp_path_factory.mktemp("single_cases")

    def case(name: str, how: str) -> tuple[Path, dict[str, Any]]:
        if (name, how) not in done:
            folder = root / jobs.case_id(name, how)
            jobs.prepare(single_run, folder, name, how)
            done[name, how] = folder, jobs.outcome(lambda: jobs.trainer(folder, "single"), folder)
        return done[name, how]

    return case


def test_an_intact_copy_resumes_from_its_newest_checkpoint(single) -> None:
    """The control: copies resume from checkpoint-4, so a fallback in the cases is the damage's doing."""
    _, result = single("-", "intact")
    assert result == {"auto": jobs.DAMAGED, "auto_error": None, "skipped": [], "path": jobs.DAMAGED, "refused": None}


@pytest.mark.parametrize(("kind", "name", "how"), _params("single"))
def test_auto_resume_falls_back_and_says_why(single, kind: str, name: str, how: str) -> None:
    folder, result = single(name, how)
    _falls_back(result, name, how)
    assert (folder / jobs.DAMAGED).is_dir(), "a damaged checkpoint is skipped, never deleted by resume"


@pytest.mark.parametrize(("kind", "name", "how"), _params("single"))
def test_resuming_the_damaged_checkpoint_by_path_is_refused(single, kind: str, name: str, how: str) -> None:
    folder, result = single(name, how)
    _refused(result, folder)


@pytest.mark.parametrize(("kind", "name", "how"), _params("single"))
def test_the_reasons_name_the_damaged_file(single, kind: str, name: str, how: str) -> None:
    _, result = single(name, how)
    assert _named(result["skipped"][0], name, how), result["skipped"]
    if result["refused"] is not None:  # COMPLETE deleted: not refused (above)
        assert _named(result["refused"], name, how), result["refused"]


# ------------------------------------------------------------------------------------------------- 2 ranks


def _multi(out: Path, strategy: str) -> tuple[Path, list[dict[str, Any]]]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run_ranks(jobs.JOB, 2, str(out), strategy, timeout=280)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    return _multi(tmp_path_factory.mktemp("fsdp_matrix"), "fsdp")


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    return _multi(tmp_path_factory.mktemp("deepspeed_matrix"), "deepspeed")


@pytest.fixture
def multi(request: pytest.FixtureRequest) -> tuple[Path, list[dict[str, Any]]]:
    return request.getfixturevalue(request.param)


FSDP = [pytest.param("fsdp", marks=pytest.mark.distributed, id="fsdp")]
DEEPSPEED = [pytest.param("deepspeed", marks=[pytest.mark.distributed, pytest.mark.deepspeed], id="deepspeed")]


def _multi_params(strategy: str, marks=None) -> list[Any]:
    """(multi, kind, name, how) with the strategy's markers on every case."""
    (setting,) = FSDP if strategy == "fsdp" else DEEPSPEED
    return [
        pytest.param(strategy, *case.values, id=f"{strategy}-{case.id}", marks=[*setting.marks, *(case.marks or ())])
        for case in _params(strategy, marks)
    ]


CASES = _multi_params("fsdp") + _multi_params("deepspeed")


@pytest.mark.parametrize("multi", FSDP + DEEPSPEED, indirect=True)
def test_an_intact_sharded_copy_resumes_from_its_newest_checkpoint_on_both_ranks(multi) -> None:
    _, ranks = multi
    for rank in ranks:
        intact = rank[jobs.case_id("-", "intact")]
        assert (intact["auto"], intact["path"], intact["auto_error"], intact["refused"]) == (
            jobs.DAMAGED,
            jobs.DAMAGED,
            None,
            None,
        ), intact


@pytest.mark.parametrize(("multi", "kind", "name", "how"), CASES, indirect=["multi"])
def test_both_ranks_fall_back_and_rank_0_says_why(multi, kind: str, name: str, how: str) -> None:
    _, (first, second) = multi
    _falls_back(first[jobs.case_id(name, how)], name, how)
    _falls_back(second[jobs.case_id(name, how)], name, how, logged=False)  # only the main process logs


@pytest.mark.parametrize(("multi", "kind", "name", "how"), CASES, indirect=["multi"])
def test_both_ranks_refuse_the_damaged_sharded_checkpoint_with_one_reason(
    multi, kind: str, name: str, how: str
) -> None:
    out, ranks = multi
    results = [rank[jobs.case_id(name, how)] for rank in ranks]
    for result in results:
        _refused(result, out / "cases" / jobs.case_id(name, how))
    assert results[0]["refused"] == results[1]["refused"], "every rank gives the same reason"


@pytest.mark.parametrize(
    ("multi", "kind", "name", "how"),
    _multi_params("fsdp") + _multi_params("deepspeed"),
    indirect=["multi"],
)
def test_the_sharded_reasons_name_the_damaged_file(multi, kind: str, name: str, how: str) -> None:
    _, (first, _) = multi
    result = first[jobs.case_id(name, how)]
    assert _named(result["skipped"][0], name, how), result["skipped"]
    assert _named(result["refused"], name, how), result["refused"]


@pytest.mark.parametrize(("multi", "kind", "name", "how"), CASES, indirect=["multi"])
def test_one_process_verification_of_the_sharded_checkpoint_refuses_it(
    multi, tmp_path: Path, kind: str, name: str, how: str
) -> None:
    """The same damage to a fresh copy of the 2-rank run, checked on one process (every checksum read here)."""
    out, _ = multi
    jobs.prepare(out / "run", tmp_path / "case", name, how)
    chosen, skipped = newest_complete(tmp_path / "case", kind="trainer")
    assert chosen == tmp_path / "case" / jobs.PREVIOUS, skipped
    assert len(skipped) == 1 and skipped[0].startswith(f"{jobs.DAMAGED}: ") and _named(skipped[0], name, how)
    with pytest.raises(CheckpointError) as refused:
        verify(tmp_path / "case" / jobs.DAMAGED, kind="trainer")
    assert _named(str(refused.value), name, how), refused.value
