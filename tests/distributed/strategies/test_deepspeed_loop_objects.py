"""accelerate's DeepSpeed names for loops: ``DeepSpeedPlugin``, ``DummyOptim``, ``DummyScheduler``.

The rules between a loop's objects and the config's blocks, and a scheduler built by a callable, run on one real
DeepSpeed rank (``ds_loop_objects_job``); the by-feature script itself is compared with accelerate's in
``tests/accelerator_parity`` (scenario ``deepspeed_config_support``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.strategies import ds_loop_objects_job as job
from tests.helpers.ranks import run_ranks
from trainer_ext import (
    Accelerator,
    ConfigError,
    DeepSpeedPlugin,
    DummyOptim,
    DummyScheduler,
    FullyShardedDataParallelPlugin,
)
from trainer_ext.distributed.strategies.deepspeed.config import DeepSpeedConfig


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ds_loop_objects")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")
        run_ranks(job, 1, str(out), timeout=300)
    return json.loads((out / "results.json").read_text())


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_config_blocks_and_loop_objects_follow_accelerates_rules(results: dict) -> None:
    r = results["refusals"]
    expected = {
        "torch_optimizer_with_block": "You cannot specify an optimizer in the config file and in the code",
        "dummy_optimizer_without_block": "You cannot create a `DummyOptim` without specifying an optimizer",
        "torch_scheduler_with_block": "You cannot specify a scheduler in the config file and in the code",
        "dummy_scheduler_without_block_or_callable": "Either specify a scheduler in the config file or pass in",
        "dummy_optimizer_with_own_scheduler": "A `DummyOptim` stands for the config's optimizer",
    }
    for case, words in expected.items():
        assert r[case]["error"] == "ConfigError" and r[case]["message"].startswith(words), (case, r[case])
    # the blocks' optimizer and scheduler come back in the placeholders' places; an lr the config writes out wins
    assert r["both_blocks"]["accepted"] == [
        "DeepSpeedEngine",
        "EngineOptimizer",
        "SteppedByEngine",
        "ShardedDataLoader",
    ]
    assert r["explicit_lr_is_the_configs"]["lr"] == 0.5


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_dummy_scheduler_callable_builds_on_the_configs_optimizer(results: dict) -> None:
    c = results["callable"]
    # LambdaLR(1 / (s + 1)) on lr 0.1, stepped once per optimizer step by DeepSpeed (4 batches), not again by the loop
    assert c["lrs"] == pytest.approx([0.1 / 2, 0.1 / 3, 0.1 / 4, 0.1 / 5])
    assert c["scheduler"] == "SteppedByEngine" and c["zero_stage"] == 2
    # the dict a script read before prepare is filled in place
    assert c["optimizer_lr"] == 0.1 and c["micro_batch"] == 4


def test_plugin_from_fields_is_accelerates_default_config() -> None:
    plugin = DeepSpeedPlugin(zero_stage=3, gradient_clipping=0.5, offload_optimizer_device="cpu")
    config = plugin.deepspeed_config
    assert config["zero_optimization"]["stage"] == 3 and plugin.zero3_init_flag
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert config["gradient_clipping"] == 0.5 and plugin.is_auto("train_micro_batch_size_per_gpu")
    assert plugin.is_auto("gradient_accumulation_steps") and config["steps_per_print"] == float("inf")
    assert DeepSpeedPlugin().zero_stage == 2 and not DeepSpeedPlugin().zero3_init_flag


def test_plugin_from_a_config_fills_its_autos_and_reads_its_values(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": "auto"}))
    plugin = DeepSpeedPlugin(hf_ds_config=str(path), gradient_clipping=2.0)
    assert plugin.deepspeed_config["gradient_clipping"] == 2.0 and plugin.gradient_clipping == 2.0
    assert plugin.zero_stage == 1 and plugin.deepspeed_config["gradient_accumulation_steps"] == 1
    assert not plugin.zero3_init_flag
    with pytest.raises(ConfigError, match="ZeRO optimization"):
        DeepSpeedPlugin(hf_ds_config={"train_batch_size": 8})
    with pytest.raises(ConfigError, match="not supported|does not have|not have"):
        DeepSpeedPlugin(enable_msamp=True)


def test_view_of_a_deepspeed_config_leaves_it_unchanged() -> None:
    config = DeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"})
    before = json.dumps(config.config, sort_keys=True)
    plugin = DeepSpeedPlugin.view(config)
    assert plugin.zero_stage == 3 and plugin.zero3_init_flag and plugin.deepspeed_config is config.config
    assert json.dumps(config.config, sort_keys=True) == before


def test_without_deepspeed_the_plugin_is_none_and_placeholders_are_refused() -> None:
    accelerator = Accelerator(cpu=True)
    assert accelerator.deepspeed_plugin is None and accelerator.state.deepspeed_plugin is None
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="DummyOptim stands for .* runs no DeepSpeed"):
        accelerator.prepare(model, DummyOptim(model.parameters()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="DummyScheduler stands for"):
        accelerator.prepare(model, optimizer, DummyScheduler(optimizer))


def test_plugin_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="trainer_ext.DeepSpeedPlugin"):
        Accelerator(cpu=True, deepspeed_plugin=object())
    with pytest.raises(ConfigError, match="several DeepSpeed plugins"):
        Accelerator(cpu=True, deepspeed_plugins={"a": DeepSpeedPlugin()})
    with pytest.raises(ConfigError, match="both"):
        Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(), deepspeed_plugins=DeepSpeedPlugin())
    with pytest.raises(ConfigError, match="give one"):
        Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(), deepspeed_config={"zero_optimization": {}})


def test_a_launched_deepspeed_config_and_fsdp_in_the_script_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_ext import TrainingArguments

    monkeypatch.setenv("TRAINER_EXT_DEEPSPEED_CONFIG", '{"zero_optimization": {"stage": 2}}')
    with pytest.raises(ConfigError, match="trainer-ext launch was given a DeepSpeed config .* drop the FSDP settings"):
        Accelerator(cpu=True, fsdp_config={"reshard_after_forward": True})
    with pytest.raises(ConfigError, match="trainer-ext launch was given a DeepSpeed config .* drop the FSDP settings"):
        Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    with pytest.raises(ConfigError, match="trainer-ext launch was given a DeepSpeed config .* drop --fsdp"):
        TrainingArguments(output_dir="unused", fsdp="full_shard", report_to=[])
