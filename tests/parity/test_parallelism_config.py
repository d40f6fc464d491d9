"""Our ``ParallelismConfig`` against accelerate's over a grid of sizes, built without a process group: the same
configurations are refused, and every accepted one has the same sizes, dimension names and mesh shape.

Deliberate differences: sequence parallelism (``sp_size`` > 1) is refused by ours until it is implemented; ours
defaults ``cp_backend`` to ``auto`` (torch's ring attention on CUDA, ours elsewhere) where accelerate's only backend is
``torch``; our refusals are ``ConfigError`` (a ``ValueError``) with our own wording. Needs accelerate for
the stock side (see tests/parity/README.md).
"""

from __future__ import annotations

import itertools

import pytest

from tests.helpers.stock_side import skip_without_accelerate
from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.errors import ConfigError

pytestmark = [pytest.mark.parity, skip_without_accelerate("see tests/parity/README.md")]

PROPERTIES = (
    "dp_replicate_size",
    "dp_shard_size",
    "tp_size",
    "cp_size",
    "sp_size",
    "cp_backend",
    "sp_backend",
    "total_size",
    "data_parallel_size",
    "non_data_parallel_size",
    "dp_replicate_enabled",
    "dp_shard_enabled",
    "tp_enabled",
    "cp_enabled",
    "sp_enabled",
    "dp_dim_names",
    "non_dp_dim_names",
    "dp_shard_cp_dim_names",
    "dp_cp_dim_names",
    "fsdp_dim_names",
    "active_mesh_dims",
)
GRID = [
    dict(dp_replicate_size=r, dp_shard_size=s, tp_size=t, cp_size=c, sp_size=p)
    for r, s, t, c, p in itertools.product((0, 1, 2, 3), (1, 2, 4), (1, 2), (1, 2), (1, 2))
]
SIZE_VARIABLES = [f"PARALLELISM_CONFIG_{n}_SIZE" for n in ("DP_REPLICATE", "DP_SHARD", "TP", "CP", "SP")]


def _build(cls: type, sizes: dict) -> object:
    try:
        return cls(**sizes)
    except ValueError as exc:
        return exc


def _observed(pc: object) -> dict:
    return {name: getattr(pc, name) for name in PROPERTIES} | {"mesh": pc._get_mesh(), "tp_handler": pc.tp_handler}


@pytest.mark.parametrize("sizes", GRID, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_same_answers_as_accelerate(sizes: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import ParallelismConfig as StockConfig

    for name in SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    stock, ours = _build(StockConfig, sizes), _build(ParallelismConfig, sizes)
    if isinstance(stock, Exception):
        assert isinstance(ours, ConfigError), f"accelerate refuses {sizes} ({stock}); ours accepts it"
        return
    if sizes["sp_size"] > 1:
        assert isinstance(ours, ConfigError) and "not supported yet" in str(ours)
        return
    assert not isinstance(ours, Exception), f"accelerate accepts {sizes}; ours refuses it: {ours}"
    stock_seen, ours_seen = _observed(stock), _observed(ours)
    assert (stock_seen.pop("tp_handler") is None) == (ours_seen.pop("tp_handler") is None)
    assert (stock_seen.pop("cp_backend"), ours_seen.pop("cp_backend")) == ("torch", "auto")
    assert ours_seen == stock_seen


def test_same_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import ParallelismConfig as StockConfig

    for name, value in zip(SIZE_VARIABLES, ("2", "2", "2", "1", "1"), strict=True):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_BACKEND", "torch")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    assert _observed(ParallelismConfig()) | {"tp_handler": None} == _observed(StockConfig()) | {"tp_handler": None}
