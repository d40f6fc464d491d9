"""accelerate's ``FullyShardedDataParallelPlugin`` on trainer_ext: its fields read into FSDP2 settings, read back as
accelerate leaves them, its refusals, and the launcher's settings for an ``Accelerator()`` that names none.

Training with it runs on 2 real gloo ranks (``fsdp_jobs plugin``); accelerate's FSDP guide loop is compared with
stock accelerate in ``tests/accelerator_parity`` (scenario ``fsdp_plugin``), the launcher end to end in
``tests/cli/test_launch_run.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, StateDictType
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from tests.distributed.strategies import fsdp_jobs
from tests.helpers.ranks import run_ranks
from trainer_ext import ConfigError, FullyShardedDataParallelPlugin, TrainingArguments
from trainer_ext.accelerator.setup import fsdp_settings
from trainer_ext.distributed.strategies.fsdp.config import FSDPSettings
from trainer_ext.env_vars import FSDP_CONFIG

LAYERS = ["LlamaDecoderLayer"]


def test_accelerates_defaults_are_fsdp2_of_the_root_only(monkeypatch) -> None:
    monkeypatch.delenv(FSDP_CONFIG, raising=False)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.settings == FSDPSettings(auto_wrap_policy="none")  # accelerate's NO_WRAP, resharded, no offload
    assert plugin.auto_wrap_policy is None and plugin.reshard_after_forward is True
    assert isinstance(plugin.cpu_offload, OffloadPolicy) and not isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert type(plugin.state_dict_config).__name__ == "ShardedStateDictConfig"
    assert plugin.mixed_precision_policy is None and plugin.activation_checkpointing is False


def test_fields_become_settings_and_read_back_as_accelerate_leaves_them(monkeypatch) -> None:
    monkeypatch.delenv(FSDP_CONFIG, raising=False)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=False,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap="LlamaDecoderLayer,LlamaMLP",
        cpu_offload=True,
        activation_checkpointing=True,
        mixed_precision_policy={"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
        use_orig_params=True,  # FSDP1's: dropped, as accelerate drops it under FSDP2
    )
    assert plugin.settings == FSDPSettings(
        reshard_after_forward=False,
        auto_wrap_policy="transformer",
        transformer_layer_cls_to_wrap=("LlamaDecoderLayer", "LlamaMLP"),
        cpu_offload=True,
        activation_checkpointing=True,
        param_dtype="bfloat16",
        reduce_dtype="float32",
    )
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer", "LlamaMLP"]
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) and plugin.use_orig_params is None
    assert plugin.mixed_precision_policy == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    sized = FullyShardedDataParallelPlugin(auto_wrap_policy=size_based_auto_wrap_policy, min_num_params=2000)
    assert sized.settings.auto_wrap_policy == "size" and sized.settings.min_num_params == 2000
    assert sized.auto_wrap_policy is size_based_auto_wrap_policy
    # the deprecated FSDP1 strategy names still mean what they meant (with the version left unset)
    assert not FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP").settings.reshard_after_forward
    assert FullyShardedDataParallelPlugin(mixed_precision_policy="fp16").settings.param_dtype == "float16"
    plugin.set_state_dict_type("FULL_STATE_DICT")
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"fsdp_version": 1}, "trainer_ext trains with FSDP2"),
        ({"fsdp_version": 2, "forward_prefetch": False}, "forward_prefetch is not yet implemented in FSDP2"),
        ({"state_dict_type": "LOCAL_STATE_DICT"}, "FSDP2 does not support LOCAL_STATE_DICT"),
        ({"fsdp_version": 2, "sharding_strategy": "FULL_SHARD"}, "reshard_after_forward set to None"),
        ({"reshard_after_forward": "FULL_SHARD"}, "reshard_after_forward"),
        ({"sharding_strategy": "NO_SHARD"}, "NO_SHARD replicates the whole model"),
        ({"auto_wrap_policy": "layer_wrap"}, "unknown auto_wrap_policy"),
        ({"auto_wrap_policy": lambda module: True}, "wraps by layer class"),
        ({"min_num_params": "2000", "auto_wrap_policy": "size_based_wrap"}, "`min_num_params` must be an integer"),
        ({"ignored_modules": ["lm_head"]}, "ignored_modules is not supported"),
        ({"activation_checkpointing": True, "activation_checkpointing_offload": True}, "not supported"),
        ({"mixed_precision_policy": "fp64"}, "invalid mixed_precision_policy"),
    ],
)
def test_settings_fsdp2_cannot_apply_are_refused(monkeypatch, fields: dict, words: str) -> None:
    monkeypatch.delenv(FSDP_CONFIG, raising=False)
    with pytest.raises(ConfigError) as caught:
        FullyShardedDataParallelPlugin(**fields)
    assert words in str(caught.value)


def test_the_launchers_settings_fill_the_fields_left_unset(monkeypatch) -> None:
    monkeypatch.setenv(
        FSDP_CONFIG, json.dumps({"reshard_after_forward": False, "transformer_layer_cls_to_wrap": LAYERS})
    )
    launched = FullyShardedDataParallelPlugin()
    # the launch's settings are whole: a key it leaves out has FSDPSettings' default (transformer-based wrap)
    assert launched.settings == FSDPSettings(reshard_after_forward=False, transformer_layer_cls_to_wrap=tuple(LAYERS))
    assert launched.auto_wrap_policy is transformer_auto_wrap_policy
    # a field the script sets wins over the launch
    assert FullyShardedDataParallelPlugin(reshard_after_forward=True).settings.reshard_after_forward is True
    for bad in ("{not json", "[1, 2]"):
        monkeypatch.setenv(FSDP_CONFIG, bad)
        with pytest.raises(ConfigError, match="is not the JSON object trainer-ext launch writes"):
            FullyShardedDataParallelPlugin()


def test_accelerator_arguments_choose_one_source(monkeypatch) -> None:
    monkeypatch.delenv(FSDP_CONFIG, raising=False)
    plugin = FullyShardedDataParallelPlugin()
    assert fsdp_settings(plugin, None, False) == (plugin.settings, plugin)
    assert fsdp_settings(None, None, False) == (None, None)
    settings, view = fsdp_settings(None, {"reshard_after_forward": False}, False)  # fsdp_config=: a view to read
    assert settings == FSDPSettings(reshard_after_forward=False) and view.reshard_after_forward is False
    assert view.auto_wrap_policy is transformer_auto_wrap_policy and view.settings is settings
    with pytest.raises(ConfigError, match="fsdp_plugin and fsdp_config both configure FSDP"):
        fsdp_settings(plugin, {"reshard_after_forward": False}, False)
    with pytest.raises(TypeError, match="`fsdp_plugin` must be a FullyShardedDataParallelPlugin object"):
        fsdp_settings({"reshard_after_forward": False}, None, False)
    monkeypatch.setenv(FSDP_CONFIG, json.dumps({"reshard_after_forward": False}))
    assert fsdp_settings(None, None, False)[0] == FSDPSettings(reshard_after_forward=False)
    with pytest.raises(ConfigError, match="launch without --fsdp_config, or drop the DeepSpeed settings"):
        fsdp_settings(None, None, True)


def test_training_arguments_take_the_launch_unless_they_ask_for_deepspeed(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(FSDP_CONFIG, json.dumps({"reshard_after_forward": False}))
    with pytest.raises(ConfigError, match="launch without --fsdp_config, or drop --deepspeed"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed={"zero_optimization": {"stage": 2}}, report_to=[])


@pytest.fixture(scope="module")
def plugin_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_plugin")
    run_ranks(fsdp_jobs, 2, str(out), "plugin", timeout=600)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_plugin_trains_as_the_same_fsdp_config_and_the_launched_settings(plugin_ranks: Path) -> None:
    result = json.loads((plugin_ranks / "plugin.json").read_text())
    by_plugin = load_file(str(plugin_ranks / "plugin_by_plugin.safetensors"))
    for other in ("by_config", "launched"):
        theirs = load_file(str(plugin_ranks / f"plugin_{other}.safetensors"))
        assert theirs.keys() == by_plugin.keys()
        assert all(torch.equal(theirs[k], by_plugin[k]) for k in by_plugin), other
    # each decoder layer sharded on its own, then the root; accelerate's default (NO_WRAP) shards the root only
    layers = result["by_plugin"]["wrapped"]
    assert layers.count("FSDPLlamaDecoderLayer") == 2 and layers[0] == "FSDPLlamaForCausalLM", layers
    assert result["by_plugin"]["same_plugin"] is True
    assert result["launched"]["wrapped"] == layers
    assert result["launched"]["reshard_after_forward"] is False
    assert result["launched"]["auto_wrap_policy"] == "transformer_auto_wrap_policy"
    assert "launch without --fsdp_config" in result["launched"]["with_deepspeed"]
    assert result["default_wraps"] == ["FSDPLlamaForCausalLM"]
