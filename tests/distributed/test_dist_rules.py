"""Tier 1: combination rules and the strategy registry."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trainer_ext.distributed import STRATEGIES, DistState, Engine, Topology, resolve_strategy
from trainer_ext.distributed.rules import check_precision, check_world
from trainer_ext.distributed.strategies import DDPStrategy, SingleDeviceStrategy
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


# --- GPU-dependent rules, checked here with a pretend GPU -------------------------------------------------
_CUDA = torch.device("cuda", 0)


@pytest.fixture()
def fake_gpu(monkeypatch: pytest.MonkeyPatch):
    """Pretend device 0 is a GPU with the given capability / bf16 support (nothing is allocated)."""

    def _make(capability: tuple[int, int] = (9, 0), bf16: bool = True, torchao: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Pretend GPU")
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: (object() if torchao else None) if name == "torchao" else real(name, *a),
        )

    return _make


def test_bf16_on_a_gpu_without_bf16(fake_gpu) -> None:
    fake_gpu(capability=(7, 5), bf16=False)
    with pytest.raises(ConfigError, match="bf16 is not supported by Pretend GPU.*--fp16"):
        check_precision("bf16", _CUDA)


def test_fp8_below_compute_capability_8_9(fake_gpu) -> None:
    fake_gpu(capability=(8, 0))
    with pytest.raises(ConfigError, match=r"compute capability >= 8\.9.*has 8\.0"):
        check_precision("fp8", _CUDA)


def test_fp8_without_torchao(fake_gpu) -> None:
    fake_gpu(capability=(9, 0), torchao=False)
    with pytest.raises(ConfigError, match=r"pip install 'torchao>=0\.10'"):
        check_precision("fp8", _CUDA)


def test_fp8_on_a_capable_gpu_with_torchao_passes(fake_gpu) -> None:
    fake_gpu(capability=(9, 0), torchao=True)
    check_precision("fp8", _CUDA)
    check_precision("fp16", _CUDA)
    check_precision("bf16", _CUDA)
