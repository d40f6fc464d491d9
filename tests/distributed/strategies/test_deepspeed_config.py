"""DeepSpeed config logic without a process group: loading, validation, "auto" resolution, transformers' view.

None of this needs deepspeed installed; the strategy's error without it is tested here too.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.paths import CONFIGS
from trainer_ext.distributed.strategies.deepspeed.config import (
    DeepSpeedConfig,
    DeepSpeedInputs,
    check_resolved,
    finalize,
    load_deepspeed_config,
    model_hidden_size,
    register_with_transformers,
    resolve_auto,
    unregister_from_transformers,
)
from trainer_ext.errors import ConfigError

PRESETS = sorted((CONFIGS / "deepspeed").glob("*.json"))
INPUTS = DeepSpeedInputs(
    world_size=2,
    micro_batch_size=4,
    gradient_accumulation_steps=3,
    max_grad_norm=0.5,
    learning_rate=2e-5,
    adam_beta1=0.8,
    adam_beta2=0.99,
    adam_epsilon=1e-6,
    weight_decay=0.1,
    bf16=True,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(text)
    return path


# -- loading ----------------------------------------------------------------------------------------
def test_malformed_json_names_file_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, '{\n  "zero_optimization": {\n    "stage": 2,\n  }\n}\n')
    with pytest.raises(ConfigError) as info:
        load_deepspeed_config(path)
    message = str(info.value)
    assert str(path) in message and "line 4, column 3" in message and "not valid JSON" in message


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_deepspeed_config(tmp_path / "nope.json")


def test_duplicate_key_and_non_object_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="duplicate key 'gradient_clipping'"):
        load_deepspeed_config(write(tmp_path, '{"gradient_clipping": 1, "gradient_clipping": 2}'))
    with pytest.raises(ConfigError, match="JSON object"):
        load_deepspeed_config(write(tmp_path, "[1, 2]"))


def test_a_dict_is_deep_copied() -> None:
    source = {"zero_optimization": {"stage": 1}}
    loaded = load_deepspeed_config(source)
    loaded["zero_optimization"]["stage"] = 2
    assert source["zero_optimization"]["stage"] == 1


# -- validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [4, -1, "3", True, None])
def test_unknown_zero_stage_lists_the_valid_ones(stage: object) -> None:
    with pytest.raises(ConfigError, match="valid stages are 0, 1, 2, 3"):
        load_deepspeed_config({"zero_optimization": {"stage": stage}})


@pytest.mark.parametrize("block", ["offload_param", "offload_optimizer"])
def test_nvme_offload_without_path_says_which_key_to_add(block: str) -> None:
    config = {"zero_optimization": {"stage": 3, block: {"device": "nvme"}}}
    with pytest.raises(ConfigError) as info:
        load_deepspeed_config(config)
    assert f"zero_optimization.{block}" in str(info.value) and '"nvme_path"' in str(info.value)
    config["zero_optimization"][block]["nvme_path"] = "/local_nvme"
    load_deepspeed_config(config)


def test_offload_needs_a_stage_that_supports_it() -> None:
    with pytest.raises(ConfigError, match="needs ZeRO stage 3"):
        load_deepspeed_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="stage 1, 2 or 3"):
        load_deepspeed_config({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="'gpu' is not one of"):
        load_deepspeed_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})


def test_fp16_and_bf16_both_enabled_is_refused() -> None:
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled are both true"):
        load_deepspeed_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    load_deepspeed_config({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}})


# -- "auto" resolution ------------------------------------------------------------------------------
def full_auto() -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }


def test_auto_takes_every_value_from_the_training_arguments() -> None:
    config = resolve_auto(full_auto(), INPUTS)
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 2 * 4 * 3
    assert config["gradient_clipping"] == 0.5
    assert config["optimizer"]["params"] == {"lr": 2e-5, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}
    assert config["scheduler"]["params"]["warmup_min_lr"] == 0
    assert config["scheduler"]["params"]["warmup_max_lr"] == 2e-5
    assert config["fp16"]["enabled"] is False and config["bf16"]["enabled"] is True
    # phase 2 values wait for the model and the schedule
    assert config["scheduler"]["params"]["total_num_steps"] == "auto"
    assert config["zero_optimization"]["reduce_bucket_size"] == "auto"
    with pytest.raises(ConfigError, match="still has 'auto' values"):
        check_resolved(config)


def test_resolution_does_not_touch_its_input() -> None:
    original = full_auto()
    resolve_auto(original, INPUTS)
    assert original == full_auto()


def test_missing_keys_deepspeed_needs_are_filled() -> None:
    config = resolve_auto({"zero_optimization": {"stage": 2}}, INPUTS)
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 24
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True}
    assert "fp16" not in config  # off by default in DeepSpeed; nothing to say
    assert "optimizer" not in config and "scheduler" not in config  # the Trainer's own are used
    no_clip = resolve_auto({}, DeepSpeedInputs(max_grad_norm=None))
    assert no_clip["gradient_clipping"] == 0.0


def test_explicit_values_that_agree_are_kept() -> None:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5, "bf16": {"enabled": True}}
    resolved = resolve_auto(config, INPUTS)
    assert resolved["train_micro_batch_size_per_gpu"] == 4 and resolved["train_batch_size"] == 24


def test_every_conflict_is_listed_with_both_values() -> None:
    config = full_auto()
    config.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1, train_batch_size=16)
    config["gradient_clipping"] = 1.0
    config["optimizer"]["params"].update(lr=1e-3, betas=[0.9, 0.999])
    config["fp16"]["enabled"] = True
    config["bf16"]["enabled"] = False
    with pytest.raises(ConfigError) as info:
        resolve_auto(config, INPUTS, source="ds.json")
    message = str(info.value)
    assert message.startswith("DeepSpeed config ds.json contradicts the TrainingArguments")
    expected = [
        "train_micro_batch_size_per_gpu=8 in the DeepSpeed config but --per_device_train_batch_size=4",
        "gradient_accumulation_steps=1 in the DeepSpeed config but --gradient_accumulation_steps=3",
        "train_batch_size=16 in the DeepSpeed config but world_size x --per_device_train_batch_size x "
        "--gradient_accumulation_steps = 2 x 4 x 3 = 24",
        "gradient_clipping=1.0 in the DeepSpeed config but --max_grad_norm=0.5",
        "optimizer.params.lr=0.001 in the DeepSpeed config but --learning_rate=2e-05",
        "optimizer.params.betas=[0.9, 0.999] in the DeepSpeed config but --adam_beta1=0.8 --adam_beta2=0.99",
        "fp16.enabled=true in the DeepSpeed config but --fp16=False",
        "bf16.enabled=false in the DeepSpeed config but --bf16=True",
    ]
    for line in expected:
        assert f"  - {line}" in message
    assert message.count("  - ") == len(expected)
    assert '"auto"' in message  # says how to fix it


def test_finalize_fills_bucket_sizes_and_schedule_like_transformers() -> None:
    config = finalize(resolve_auto(full_auto(), INPUTS), hidden_size=64, num_training_steps=100, num_warmup_steps=0)
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 640
    assert config["scheduler"]["params"]["total_num_steps"] == 100
    assert config["scheduler"]["params"]["warmup_num_steps"] == 1  # DeepSpeed refuses 0
    check_resolved(config)


def test_finalize_names_what_it_could_not_resolve() -> None:
    with pytest.raises(ConfigError) as info:
        finalize(resolve_auto(full_auto(), INPUTS))
    message = str(info.value)
    assert "zero_optimization.reduce_bucket_size (needs the model's hidden_size" in message
    assert "scheduler.params.total_num_steps (needs the number of training/warm-up steps)" in message


def test_finalize_reports_contradicting_schedule() -> None:
    config = resolve_auto(full_auto(), INPUTS)
    config["scheduler"]["params"]["total_num_steps"] = 50
    with pytest.raises(ConfigError, match="total_num_steps=50 in the DeepSpeed config but num_training_steps=100"):
        finalize(config, hidden_size=8, num_training_steps=100, num_warmup_steps=5)


def test_inputs_from_training_arguments() -> None:
    from trainer_ext import TrainingArguments

    args = TrainingArguments(
        "out",
        per_device_train_batch_size=3,
        gradient_accumulation_steps=5,
        max_grad_norm=0.3,
        learning_rate=1e-4,
        weight_decay=0.05,
        use_cpu=True,
        report_to="none",
    )
    inputs = DeepSpeedInputs.from_training_args(args, world_size=4)
    assert (inputs.world_size, inputs.micro_batch_size, inputs.gradient_accumulation_steps) == (4, 3, 5)
    assert inputs.train_batch_size == 60
    assert (inputs.max_grad_norm, inputs.learning_rate, inputs.weight_decay) == (0.3, 1e-4, 0.05)
    assert not inputs.fp16 and not inputs.bf16


def test_model_hidden_size() -> None:
    from tests.helpers.tiny import tiny_llama

    assert model_hidden_size(tiny_llama(0)) == 32
    assert model_hidden_size(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("path", PRESETS, ids=[p.name for p in PRESETS])
def test_every_preset_loads_and_resolves(path: Path) -> None:
    config = load_deepspeed_config(path)
    assert "optimizer" not in config and "scheduler" not in config  # the Trainer's own are used
    resolved = finalize(resolve_auto(config, INPUTS), hidden_size=32, num_training_steps=10, num_warmup_steps=1)
    check_resolved(resolved)
    assert resolved["train_batch_size"] == 24 and resolved["bf16"]["enabled"] is True
    stage = resolved["zero_optimization"]["stage"]
    assert path.stem.startswith(f"zero{stage}")
    if stage == 3:
        assert resolved["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
        assert resolved["zero_optimization"]["stage3_param_persistence_threshold"] == 320
    if "offload" in path.stem:
        assert DeepSpeedConfig(resolved).is_offload()
        assert resolved["zero_force_ds_cpu_optimizer"] is False


def test_presets_are_documented() -> None:
    readme = (PRESETS[0].parent / "README.md").read_text()
    for path in PRESETS:
        assert f"`{path.name}`" in readme


# -- the object transformers queries ----------------------------------------------------------------
def test_config_object_answers_like_hf_deepspeed_config() -> None:
    config = DeepSpeedConfig(resolve_auto(full_auto(), INPUTS))
    assert config.is_zero3() and not config.is_zero2() and config.stage == 3
    assert config.get_value("optimizer.params.lr") == 2e-5
    assert config.get_value("optimizer.params.nope", 7) == 7 and config.get_value("no.such.key") is None
    node, key = config.find_config_node("optimizer.params.lr")
    assert key == "lr" and node is config.config["optimizer"]["params"]
    assert config.find_config_node("missing.deep.key") == (None, "key")
    assert config.is_true("bf16.enabled") and config.is_false("fp16.enabled")
    assert not config.is_true("nope") and not config.is_false("nope")
    assert config.is_auto("scheduler.params.total_num_steps")
    assert config.dtype() is torch.bfloat16
    assert not config.is_offload()
    config.del_config_sub_tree("optimizer")
    assert "optimizer" not in config.config
    config.del_config_sub_tree("optimizer")  # absent: a no-op unless must_exist
    with pytest.raises(ValueError):
        config.del_config_sub_tree("optimizer", must_exist=True)


def test_dtype_and_auto_flags() -> None:
    undecided = DeepSpeedConfig({"fp16": {"enabled": "auto"}})
    assert not undecided.is_true("fp16.enabled") and not undecided.is_false("fp16.enabled")
    with pytest.raises(ConfigError, match="still 'auto'"):
        undecided.dtype()
    assert undecided.resolve(DeepSpeedInputs(fp16=True)).dtype() is torch.float16
    assert DeepSpeedConfig({}).dtype() is torch.float32


def test_config_object_phases_in_place(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps(full_auto()))
    config = DeepSpeedConfig(path)
    assert config.source == str(path)
    config.resolve(INPUTS).finalize(hidden_size=8, num_training_steps=10, num_warmup_steps=2)
    check_resolved(config.config)
    conflicting = copy.deepcopy(full_auto())
    conflicting["gradient_clipping"] = 3.0
    with pytest.raises(ConfigError) as info:
        DeepSpeedConfig(write(tmp_path, json.dumps(conflicting))).resolve(INPUTS)
    assert f"DeepSpeed config {path} contradicts" in str(info.value)
    assert "gradient_clipping=3.0 in the DeepSpeed config but --max_grad_norm=0.5" in str(info.value)


@pytest.fixture
def hf_registry():
    """Restore transformers' DeepSpeed registration whatever the test does."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    yield hf_deepspeed
    hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def test_register_toggles_is_deepspeed_zero3_enabled(hf_registry) -> None:
    from transformers.integrations import deepspeed_config, is_deepspeed_zero3_enabled

    unregister_from_transformers()
    assert not is_deepspeed_zero3_enabled() and deepspeed_config() is None
    zero3 = DeepSpeedConfig({"zero_optimization": {"stage": 3}})
    register_with_transformers(zero3)
    assert is_deepspeed_zero3_enabled()
    assert deepspeed_config() is zero3.config
    zero2 = DeepSpeedConfig({"zero_optimization": {"stage": 2}})
    register_with_transformers(zero2)
    assert not is_deepspeed_zero3_enabled()
    register_with_transformers(zero3)
    unregister_from_transformers()
    assert not is_deepspeed_zero3_enabled()
    register_with_transformers(zero3)
    del zero3  # transformers holds a weak reference only
    assert not is_deepspeed_zero3_enabled()
    assert "accelerate" not in sys.modules


def test_the_hook_runs_once_on_the_first_zero3_query_only(hf_registry) -> None:
    from transformers.integrations import deepspeed_config, is_deepspeed_zero3_enabled

    calls: list[str] = []
    zero2 = DeepSpeedConfig({"zero_optimization": {"stage": 2}})
    register_with_transformers(zero2, on_first_zero3_query=lambda: calls.append("zero2"))
    assert not is_deepspeed_zero3_enabled() and deepspeed_config() is zero2.config
    zero3 = DeepSpeedConfig({"zero_optimization": {"stage": 3}})
    register_with_transformers(zero3, on_first_zero3_query=lambda: calls.append("zero3"))
    assert calls == []  # registering starts nothing
    assert deepspeed_config() is zero3.config and calls == []  # reading the dict is not a ZeRO-3 query
    assert is_deepspeed_zero3_enabled() and is_deepspeed_zero3_enabled()
    assert calls == ["zero3"]


def test_a_registered_config_pickles_and_copies_unregistered(hf_registry) -> None:
    import pickle

    from transformers.integrations import deepspeed_config

    zero3 = DeepSpeedConfig({"zero_optimization": {"stage": 3}})
    register_with_transformers(zero3, on_first_zero3_query=lambda: None)
    for clone in (pickle.loads(pickle.dumps(zero3)), copy.deepcopy(zero3)):  # torch.save(args) pickles it
        assert clone.config == zero3.config and clone.is_zero3()
    assert deepspeed_config() is zero3.config  # the original stays the registered one


def test_training_arguments_start_deepspeed_communication_only_when_transformers_asks(tmp_path: Path) -> None:
    """Building ZeRO-3 arguments starts no process group; transformers' first ZeRO-3 query (from_pretrained's
    zero.Init check) does. One process without a launcher, in a child: it creates global state."""
    pytest.importorskip("deepspeed")
    import subprocess

    script = f"""
import torch.distributed
from transformers.integrations import is_deepspeed_zero3_enabled
from trainer_ext import TrainingArguments
args = TrainingArguments({str(tmp_path)!r}, use_cpu=True, deepspeed={str(CONFIGS / "deepspeed" / "zero3.json")!r})
import deepspeed
print("after arguments", torch.distributed.is_initialized(), deepspeed.comm.is_initialized())
print("zero3", is_deepspeed_zero3_enabled())
print("after query", torch.distributed.is_initialized(), deepspeed.comm.is_initialized())
"""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("after", "zero3"))]
    assert lines == ["after arguments False False", "zero3 True", "after query True True"]


# -- the strategy's parts that need no deepspeed ----------------------------------------------------
def test_strategy_without_deepspeed_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer_ext.distributed.strategies.deepspeed.strategy as ds_strategy
    from trainer_ext.distributed import DistState

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    strategy = ds_strategy.DeepSpeedStrategy(DistState(cpu=True, init=False), {"zero_optimization": {"stage": 2}})
    assert not strategy.should_step(True) and strategy.name == "deepspeed"  # it steps inside backward
    assert strategy.setup_precision("bf16").dtype is None  # its engine casts: no autocast of ours
    with pytest.raises(ConfigError, match=r"pip install 'deepspeed>=0\.16'"):
        strategy.initialize(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))


def test_importing_the_strategy_does_not_import_deepspeed() -> None:
    import subprocess

    code = "import sys, trainer_ext.distributed.strategies.deepspeed.strategy; print('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == "False"


def test_strategy_refuses_unresolved_config_and_double_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_ext.distributed import DistState
    from trainer_ext.distributed.strategies.deepspeed.strategy import DeepSpeedStrategy

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = DistState(cpu=True, init=False)
    with pytest.raises(ConfigError, match="still has 'auto' values for train_batch_size"):
        DeepSpeedStrategy(state, {"train_batch_size": "auto"}).initialize(model, optimizer)
    both = resolve_auto({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, INPUTS)
    with pytest.raises(ConfigError, match="'optimizer' block too"):
        DeepSpeedStrategy(state, both).initialize(model, optimizer)


def test_consolidation_check_refuses_empty_and_partial_state_dicts() -> None:
    from tests.helpers.tiny import tiny_llama
    from trainer_ext.distributed.strategies.deepspeed.strategy import ConsolidationError, check_complete

    model = tiny_llama(0)
    full = model.state_dict()
    check_complete(model, full)
    with pytest.raises(ConsolidationError, match="refusing to save an empty model"):
        check_complete(model, {})
    partial = dict(full)
    partial.pop("lm_head.weight")
    with pytest.raises(ConsolidationError, match="missing 1: lm_head.weight"):
        check_complete(model, partial)
    placeholders = {k: torch.empty(0) for k in full}  # what module.state_dict() gives under ZeRO-3
    with pytest.raises(ConsolidationError, match="wrong size"):
        check_complete(model, placeholders)


@pytest.mark.deepspeed
@pytest.mark.parametrize(("flag", "dtype"), [("bf16", torch.bfloat16), (None, torch.float32)])
def test_float_inputs_take_the_engine_dtype(tmp_path: Path, hf_registry, flag: str | None, dtype) -> None:
    """Pixel values or audio reach a bf16 DeepSpeed engine in bf16; token ids stay integers."""
    from transformers import BertConfig, BertForSequenceClassification

    from trainer_ext import Trainer, TrainingArguments

    config = json.loads((PRESETS[0].parent / "zero2.json").read_text())
    flags = {flag: True} if flag else {}
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=config, use_cpu=True, report_to="none", **flags)
    tiny = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=99)
    trainer = Trainer(model=BertForSequenceClassification(tiny), args=args)
    batch = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "pixel_values": torch.zeros(2, 3),
        "extra": [torch.ones(1)],
    }
    out = trainer._prepare_inputs(batch)
    assert out["input_ids"].dtype == torch.long
    assert out["pixel_values"].dtype == dtype and out["extra"][0].dtype == dtype


def test_the_json_itself_is_accepted_in_place_of_a_path() -> None:
    """transformers takes --deepspeed '{...}'; so do we (the launcher passes accelerate's inline keys this way)."""
    assert load_deepspeed_config('  {"zero_optimization": {"stage": 2}}') == {"zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match="inline DeepSpeed JSON is not valid JSON: line 1"):
        load_deepspeed_config('{"zero_optimization": {"stage": 2}')
