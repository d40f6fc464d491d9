"""Tier 1: combination rules and the strategy registry."""

from __future__ import annotations

import pytest
import torch

from trainer_ext.dist import STRATEGIES, DistState, Engine, Topology, resolve_strategy
from trainer_ext.dist.rules import check_precision, check_world
from trainer_ext.dist.strategies import DDPStrategy, SingleDeviceStrategy
from trainer_ext.errors import ConfigError

CPU = torch.device("cpu")


def _state(world: int = 1) -> DistState:
    return DistState(Topology(rank=0, world_size=world, local_world_size=world), cpu=True, init=False)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_fp16_needs_cuda(device: str) -> None:
    with pytest.raises(ConfigError, match=rf"fp16 mixed precision needs a CUDA GPU.*runs on {device}.*--bf16"):
        check_precision("fp16", torch.device(device), fp16=True)


@pytest.mark.parametrize("mode", ["no", "bf16", "fp16"])
def test_fp16_and_bf16_together(mode: str) -> None:
    with pytest.raises(ConfigError, match="both --fp16 and --bf16"):
        check_precision(mode, CPU, fp16=True, bf16=True)


@pytest.mark.parametrize("mode, flags", [("no", {}), ("bf16", {"bf16": True})])
def test_allowed_on_cpu(mode: str, flags: dict) -> None:
    assert check_precision(mode, CPU, **flags) is None


def test_registry_names_match_classes() -> None:
    assert set(STRATEGIES) >= {"single", "ddp"}
    for name, cls in STRATEGIES.items():
        assert cls.name == name


@pytest.mark.parametrize(
    "name, hint",
    [("dpp", "Did you mean 'ddp'?"), ("singel", "Did you mean 'single'?"), ("DDP", None), ("zzz", None)],
)
def test_unknown_strategy(name: str, hint: str | None) -> None:
    with pytest.raises(ConfigError, match=rf"unknown strategy '{name}'; known: single, ddp") as info:
        resolve_strategy(_state(), name)
    if hint:
        assert str(info.value).endswith(hint)
    else:
        assert "Did you mean" not in str(info.value)


def test_unknown_strategy_through_the_engine() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'ddp'"):
        Engine(_state(), strategy="dpp")


@pytest.mark.parametrize("world", [2, 8])
def test_single_on_several_processes(world: int) -> None:
    with pytest.raises(ConfigError, match=rf"strategy 'single' cannot run on {world} processes; use 'ddp'"):
        resolve_strategy(_state(world), "single")
    with pytest.raises(ConfigError, match="cannot run on"):
        check_world(world, "single")
    assert check_world(1, "single") is None and check_world(world, "ddp") is None


@pytest.mark.parametrize("world, cls", [(1, SingleDeviceStrategy), (2, DDPStrategy)])
def test_default_strategy(world: int, cls: type) -> None:
    strategy = resolve_strategy(_state(world))
    assert type(strategy) is cls
    assert strategy.state.num_processes == world


def test_options_reach_ddp_only() -> None:
    ddp = resolve_strategy(_state(2), "ddp", find_unused_parameters=True)
    assert ddp.options == {"find_unused_parameters": True}
    single = resolve_strategy(_state(1), "single", find_unused_parameters=True)
    assert single.options == {}


def test_ddp_wrap_skips_frozen_models() -> None:
    """Nothing to synchronise: no DDP wrapper (and so no process group needed)."""
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    assert resolve_strategy(_state(2), "ddp").wrap(model) is model
