"""Bad input ends in a ConfigError that says what is wrong and how to fix it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.inference.dispatch_models import make_llama
from trainer_ext.errors import ConfigError
from trainer_ext.inference import dispatch_model, infer_auto_device_map
from trainer_ext.inference.inventory import Inventory
from trainer_ext.inference.plan import make_plan


def test_budget_too_small_for_one_layer() -> None:
    with pytest.raises(ConfigError) as caught:
        infer_auto_device_map(make_llama(), max_memory={0: "100KB", "cpu": "100KB"})
    message = str(caught.value)
    assert (
        "'model.layers.0' (a LlamaDecoderLayer, kept whole because it is in no_split_module_classes; 144.5 KiB"
        in message
    )
    assert "Budgets: cuda:0 97.7 KiB, cpu 97.7 KiB; the whole model needs 610.3 KiB" in message
    assert "Raise max_memory, or allow disk offload (max_memory['disk']" in message


def test_budget_error_mentions_what_was_held_back() -> None:
    with pytest.raises(ConfigError, match=r"32.0 KiB of cuda:0 is held back for offloaded weights"):
        infer_auto_device_map(make_llama(), max_memory={0: "200KB", "cpu": "450KB"})


def test_dispatch_with_too_little_memory_and_no_disk() -> None:
    with pytest.raises(ConfigError, match="does not fit in max_memory.*allow disk offload"):
        dispatch_model(make_llama(), max_memory={"cpu": "100KB"})


def test_disk_budget_too_small() -> None:
    with pytest.raises(ConfigError, match="raise the 'disk' budget"):
        infer_auto_device_map(make_llama(), max_memory={"cpu": "100KB", "disk": "100KB"})


def test_unknown_module_in_device_map() -> None:
    with pytest.raises(ConfigError, match=r"names 'model.layer.0', which is neither.*Did you mean 'model.layers.0'"):
        dispatch_model(make_llama(), {"model.layer.0": "cpu", "": "cpu"})


def test_unknown_device_in_device_map_and_max_memory() -> None:
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        dispatch_model(make_llama(), {"": "gpu"})
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        infer_auto_device_map(make_llama(), max_memory={"tpu": "1GB"})


def test_module_left_out_of_device_map() -> None:
    with pytest.raises(ConfigError, match=r"does not place 'lm_head.weight'.*'' places everything not listed"):
        dispatch_model(make_llama(tied=False), {"model": "cpu"})


@pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="needs a machine with fewer than 8 GPUs")
def test_gpu_that_is_not_there() -> None:
    with pytest.raises(ConfigError, match=r"uses cuda:7 but this process sees \d+ GPU\(s\)"):
        dispatch_model(make_llama(), {"model": "cpu", "lm_head": "cuda:7"})


def test_tensors_of_one_module_on_two_devices() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(
        ConfigError, match=r"tensors of module '0' would run on different devices .*0.weight -> cuda:1"
    ):
        make_plan(Inventory(model), {"0.weight": 1, "0.bias": 0})


@pytest.mark.parametrize("device_map", ["balanced", 0, ["cpu"]])
def test_device_map_forms(device_map) -> None:
    with pytest.raises(ConfigError, match="device_map"):
        dispatch_model(make_llama(), device_map)


def test_max_memory_with_a_written_map() -> None:
    with pytest.raises(ConfigError, match="max_memory is only used with device_map='auto'"):
        dispatch_model(make_llama(), {"": "cpu"}, max_memory={"cpu": "1GB"})


def test_empty_max_memory() -> None:
    with pytest.raises(ConfigError, match="max_memory is empty"):
        infer_auto_device_map(make_llama(), max_memory={})


def test_main_device_cannot_be_disk() -> None:
    with pytest.raises(ConfigError, match="main_device cannot be 'disk'"):
        dispatch_model(make_llama(), {"": "cpu"}, main_device="disk")
