"""``ParallelismConfig``'s pipeline fields (ours): defaults, variables, the explicit split, the rules with the other
dimensions, and where ``pp`` sits in the mesh. No process group."""

from __future__ import annotations

import pytest

from trainer_ext.distributed.mesh.config import PP_SCHEDULES, ParallelismConfig
from trainer_ext.distributed.mesh.device_mesh import check_world_size, fit_to_world
from trainer_ext.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SIZE", "SCHEDULE", "MICROBATCHES", "SPLIT"):
        monkeypatch.delenv(f"PARALLELISM_CONFIG_PP_{name}", raising=False)


def test_defaults_leave_the_pipeline_off() -> None:
    config = ParallelismConfig()
    assert (config.pp_size, config.pp_schedule, config.pp_microbatches, config.pp_split) == (1, "1f1b", None, None)
    assert not config.pp_enabled and not config.splits_model and config.total_size == 1


def test_the_variables_set_what_is_left_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SCHEDULE", "gpipe")
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_MICROBATCHES", "6")
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SPLIT", "3, 5")
    config = ParallelismConfig()
    assert (config.pp_size, config.pp_schedule, config.pp_microbatches, config.pp_split) == (2, "gpipe", 6, [3, 5])
    assert ParallelismConfig(pp_schedule="1f1b", pp_split=[1]).pp_split == [1]  # a field wins over its variable


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"pp_size": 2, "pp_schedule": "zigzag"}, "pp_schedule='zigzag' is unknown"),
        ({"pp_size": 2, "pp_microbatches": 0}, "pp_microbatches must be at least 1"),
        ({"pp_size": 2, "pp_split": [2, 2]}, "must be increasing"),
        ({"pp_size": 2, "pp_split": [0]}, "at least 1"),
        ({"pp_size": 2, "pp_split": ["a"]}, "is not a list of layer indices"),
        ({"pp_size": 2, "cp_size": 2, "dp_shard_size": 2}, "does not compose with context parallelism"),
        ({"pp_size": 2, "dp_replicate_size": 2}, "set dp_shard_size instead"),
    ],
)
def test_bad_pipeline_fields_are_one_line(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ParallelismConfig(**kwargs)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_every_schedule_is_accepted() -> None:
    assert [ParallelismConfig(pp_size=2, pp_schedule=name).pp_schedule for name in PP_SCHEDULES] == list(PP_SCHEDULES)


def test_pp_sits_inside_the_data_parallel_dimensions_and_shares_the_batch() -> None:
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, pp_size=2, tp_size=2)
    assert config._get_mesh() == (("dp_replicate", "dp_shard", "pp", "tp"), (2, 2, 2, 2))
    assert config.total_size == 16 and config.non_data_parallel_size == 4 and config.data_parallel_size == 4
    assert config.splits_model and config.pp_enabled


def test_pp_alone_shards_each_stage_over_the_other_processes() -> None:
    config = ParallelismConfig(pp_size=2)
    fit_to_world(config, 8)
    assert (config.dp_shard_size, config.pp_size, config.dp_replicate_size) == (4, 2, 1)
    odd = ParallelismConfig(pp_size=2)
    with pytest.raises(ConfigError, match=r"pp 2\) but the job has 3"):
        fit_to_world(odd, 3)


def test_the_world_size_refusal_names_pp_only_when_set() -> None:
    with pytest.raises(ConfigError) as plain:
        check_world_size(ParallelismConfig(tp_size=2), 4)
    with pytest.raises(ConfigError) as piped:
        check_world_size(ParallelismConfig(tp_size=2, pp_size=4), 4)
    assert "pp" not in str(plain.value) and "× pp 4" in str(piped.value)
