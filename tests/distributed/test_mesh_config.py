"""``ParallelismConfig`` in one process: accelerate's defaults, properties and environment variables, every rule
refused in one ``ConfigError`` line, and the mesh's dimension order (no process group needed)."""

from __future__ import annotations

import json
import warnings

import pytest

from trainer_ext.distributed.mesh.config import ParallelismConfig, TorchTensorParallelConfig
from trainer_ext.distributed.mesh.device_mesh import build_parallel_mesh, check_world_size, fit_to_world
from trainer_ext.errors import ConfigError

SIZE_VARIABLES = [f"PARALLELISM_CONFIG_{n}_SIZE" for n in ("DP_REPLICATE", "DP_SHARD", "TP", "CP", "SP")]


@pytest.fixture(autouse=True)
def _no_parallelism_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*SIZE_VARIABLES, "PARALLELISM_CONFIG_CP_BACKEND", "PARALLELISM_CONFIG_SP_BACKEND"]:
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_one_process_with_our_cp_backend_choice() -> None:
    pc = ParallelismConfig()
    sizes = (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size, pc.sp_size)
    assert sizes == (1, 1, 1, 1, 1)
    assert (pc.cp_backend, pc.sp_backend) == ("auto", "deepspeed")  # accelerate's cp default, "torch", runs CUDA only
    assert (pc.tp_handler, pc.cp_handler, pc.sp_handler, pc.device_mesh) == (None, None, None, None)
    assert (pc.total_size, pc.data_parallel_size, pc.non_data_parallel_size) == (1, 1, 1)
    assert pc.active_mesh_dims == [] and pc._get_mesh() == ()
    assert pc.fsdp_dim_names == ["dp_shard_cp"]


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        (
            dict(dp_shard_size=4),
            dict(dp=["dp_shard"], non_dp=[], shard_cp=["dp_shard"], dp_cp=["dp_shard"], fsdp=["dp_shard_cp"]),
        ),
        (
            dict(dp_replicate_size=2, dp_shard_size=2),
            dict(
                dp=["dp_replicate", "dp_shard"],
                non_dp=[],
                shard_cp=["dp_shard"],
                dp_cp=["dp_replicate", "dp_shard"],
                fsdp=["dp_replicate", "dp_shard_cp"],
            ),
        ),
        (
            dict(dp_shard_size=2, tp_size=2),
            dict(dp=["dp_shard"], non_dp=["tp"], shard_cp=["dp_shard"], dp_cp=["dp_shard"], fsdp=["dp_shard_cp"]),
        ),
        (dict(tp_size=2), dict(dp=[], non_dp=["tp"], shard_cp=[], dp_cp=[], fsdp=["dp_shard_cp"])),
        (
            dict(dp_replicate_size=3),
            dict(
                dp=["dp_replicate"],
                non_dp=[],
                shard_cp=[],
                dp_cp=["dp_replicate"],
                fsdp=["dp_replicate", "dp_shard_cp"],
            ),
        ),
    ],
)
def test_dimension_names(sizes: dict, expected: dict) -> None:
    pc = ParallelismConfig(**sizes)
    got = dict(
        dp=pc.dp_dim_names,
        non_dp=pc.non_dp_dim_names,
        shard_cp=pc.dp_shard_cp_dim_names,
        dp_cp=pc.dp_cp_dim_names,
        fsdp=pc.fsdp_dim_names,
    )
    assert got == expected
    assert pc.active_mesh_dims == expected["dp"] + expected["non_dp"]


def test_sizes_and_mesh_order() -> None:
    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=3, tp_size=4)
    assert (pc.total_size, pc.data_parallel_size, pc.non_data_parallel_size) == (24, 6, 4)
    assert (pc.dp_replicate_enabled, pc.dp_shard_enabled, pc.tp_enabled, pc.cp_enabled, pc.sp_enabled) == (
        True,
        True,
        True,
        False,
        False,
    )
    assert pc._get_mesh() == (("dp_replicate", "dp_shard", "tp"), (2, 3, 4))
    assert isinstance(pc.tp_handler, TorchTensorParallelConfig) and pc.tp_handler.enable_async_tp is False


def test_a_size_set_after_construction_is_seen_everywhere() -> None:
    """transformers' Trainer sets ``tp_size``/``dp_shard_size`` on a built config: the mesh follows the fields."""
    pc = ParallelismConfig()
    pc.tp_size, pc.dp_shard_size = 2, 2
    assert pc._sizes["tp"] == 2 and pc.total_size == 4
    assert pc._get_mesh() == (("dp_shard", "tp"), (2, 2))
    pc._set_size("dp_replicate", 3)
    assert pc.dp_replicate_size == 3 and pc.total_size == 12


def test_sizes_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", " 3 ")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_BACKEND", "torch")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    pc = ParallelismConfig()
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.total_size) == (2, 3, 2, 12)
    assert ParallelismConfig(tp_size=1).tp_size == 1  # an argument wins over its variable


@pytest.mark.parametrize("variable", SIZE_VARIABLES)
@pytest.mark.parametrize("text", ["two", "", "1.5"])
def test_a_bad_size_variable_is_one_line(monkeypatch: pytest.MonkeyPatch, variable: str, text: str) -> None:
    monkeypatch.setenv(variable, text)
    with pytest.raises(ConfigError, match=f"^{variable}=.*is not a whole number") as info:
        ParallelismConfig()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("variable", ["PARALLELISM_CONFIG_CP_BACKEND", "PARALLELISM_CONFIG_SP_BACKEND"])
def test_a_bad_backend_variable_is_refused(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, "ring")
    with pytest.raises(ConfigError, match="'ring' is unknown"):
        ParallelismConfig()


@pytest.mark.parametrize("name", ["dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"])
@pytest.mark.parametrize("value", [0, -2])
def test_sizes_below_one_are_refused(name: str, value: int) -> None:
    with pytest.raises(ConfigError, match=f"^ParallelismConfig {name} must be at least 1, got {name}={value}"):
        ParallelismConfig(**{name: value})


@pytest.mark.parametrize("value", ["2", 2.0, True, [2]])
def test_sizes_must_be_whole_numbers(value: object) -> None:
    with pytest.raises(ConfigError, match="tp_size=.* is not a size: pass a whole number"):
        ParallelismConfig(tp_size=value)


@pytest.mark.parametrize(("name", "value"), [("cp_backend", "ring"), ("sp_backend", "torch")])
def test_unknown_backends_are_refused(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}='{value}' is unknown"):
        ParallelismConfig(**{name: value})


def test_context_and_sequence_parallelism_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match="cp_size=2 and sp_size=2: context and sequence parallelism exclude"):
        ParallelismConfig(cp_size=2, sp_size=2)


@pytest.mark.parametrize("sizes", [dict(dp_replicate_size=2, tp_size=2), dict(dp_replicate_size=4, tp_size=3)])
def test_tensor_parallelism_with_pure_replication_is_refused(sizes: dict) -> None:
    with pytest.raises(ConfigError, match="does not compose with pure replication"):
        ParallelismConfig(dp_shard_size=1, **sizes)


def test_tensor_parallelism_composes_with_hsdp() -> None:
    assert ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2).total_size == 8


def test_sequence_parallelism_is_not_supported_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ConfigError, match="^ParallelismConfig sp_size=2: sequence .* is not supported yet; set sp_size=1"
    ):
        ParallelismConfig(dp_shard_size=2, sp_size=2)
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    with pytest.raises(ConfigError, match="not supported yet"):
        ParallelismConfig()


def test_context_parallelism_sizes_and_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    pc = ParallelismConfig(dp_shard_size=2, cp_size=2)
    assert (pc.total_size, pc.non_data_parallel_size, pc.data_parallel_size) == (4, 2, 2)
    assert pc.dp_shard_cp_dim_names == ["dp_shard", "cp"] and pc.splits_model
    assert ParallelismConfig(cp_size=2).splits_model and not ParallelismConfig(dp_replicate_size=2).splits_model
    for backend in ("auto", "torch", "all_gather"):
        assert ParallelismConfig(cp_size=2, cp_backend=backend).cp_backend == backend
    with pytest.raises(ConfigError, match="cp_backend='ring' is unknown: choose 'auto' or 'torch' or 'all_gather'"):
        ParallelismConfig(cp_size=2, cp_backend="ring")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_BACKEND", "all_gather")
    assert (ParallelismConfig().cp_size, ParallelismConfig().cp_backend) == (2, "all_gather")


def test_async_tensor_parallelism_is_ignored_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="enable_async_tp is ignored"):
        handler = TorchTensorParallelConfig(enable_async_tp=True)
    pc = ParallelismConfig(tp_size=2, tp_handler=handler)
    assert pc.tp_handler is handler


def test_to_json_is_the_fields() -> None:
    pc = ParallelismConfig(dp_shard_size=2, tp_size=2)
    out = pc.to_json()
    assert json.loads(json.dumps(out)) == out
    assert out["tp_handler"] == {"enable_async_tp": False, "tp_plan": None} and out["dp_shard_size"] == 2
    assert "device_mesh" not in out


def test_world_size_is_checked_in_one_line() -> None:
    pc = ParallelismConfig(dp_shard_size=2, tp_size=2)
    check_world_size(pc, 4)
    with pytest.raises(ConfigError, match=r"spans 4 processes \(dp_replicate 1 × dp_shard 2 × tp 2 × cp 1 × sp 1\) "):
        check_world_size(pc, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match="but the job has 1: make the sizes multiply to 1, or launch 4"):
            build_parallel_mesh(pc, "cpu")  # no process group: refused before any group work


def test_fit_to_world_replicates_a_size_one_config() -> None:
    pc = ParallelismConfig()
    fit_to_world(pc, 4)
    assert (pc.dp_replicate_size, pc.total_size, pc.dp_dim_names) == (4, 4, ["dp_replicate"])
    with pytest.raises(ConfigError, match="spans 4 processes"):
        fit_to_world(ParallelismConfig(dp_shard_size=4), 2)


def test_no_mesh_for_one_process() -> None:
    assert build_parallel_mesh(ParallelismConfig(), "cpu") is None
    pc = ParallelismConfig()
    assert pc.get_device_mesh("cpu") is None and pc.build_device_mesh("cpu") is None
    with pytest.raises(ConfigError, match="pass device_type"):
        pc.get_device_mesh()


def test_an_accelerate_config_object_takes_our_auto_cp_backend() -> None:
    """accelerate's ParallelismConfig always says cp_backend='torch' (its only choice): taken as ours it is 'auto', so
    the same object runs torch's ring attention on CUDA and ours elsewhere instead of being refused off CUDA."""
    from types import SimpleNamespace

    from trainer_ext.distributed.mesh.setup import as_parallelism_config

    theirs = SimpleNamespace(
        dp_replicate_size=1,
        dp_shard_size=1,
        tp_size=1,
        cp_size=2,
        cp_backend="torch",
        sp_size=1,
        sp_backend="deepspeed",
    )
    ours = as_parallelism_config(theirs)
    assert (ours.cp_size, ours.cp_backend) == (2, "auto")
    assert as_parallelism_config({"cp_size": 2, "cp_backend": "torch"}).cp_backend == "torch"  # a dict is ours: kept
