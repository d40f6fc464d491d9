"""FSDP2 settings, wrap units, bad input and sharded-checkpoint checks, in one process (no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers.paths import CONFIGS
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer, TrainingArguments
from trainer_ext.checkpointing import sharded as sharded_checkpoint
from trainer_ext.cli.main import main
from trainer_ext.distributed.state import DistState
from trainer_ext.distributed.strategies.fsdp.config import FSDPSettings, normalized_config, parse_fsdp
from trainer_ext.distributed.strategies.fsdp.strategy import (
    FSDPStrategy,
    checkpoint_forward,
    layer_classes,
    trainable_islands,
)
from trainer_ext.errors import ConfigError

PRESETS = CONFIGS / "fsdp"


def test_presets_parse_to_what_their_names_say() -> None:
    full = parse_fsdp(True, PRESETS / "full_shard.yaml")
    assert full.reshard_after_forward and not full.hybrid_shard and full.auto_wrap_policy == "transformer"
    assert not parse_fsdp(True, PRESETS / "shard_grad_op.yaml").reshard_after_forward
    assert parse_fsdp(True, PRESETS / "hybrid_shard.yaml").hybrid_shard
    offload = parse_fsdp(True, PRESETS / "cpu_offload.yaml")
    assert offload.cpu_offload and offload.activation_checkpointing


def test_accelerate_keys_flag_words_and_transformers_json_agree(tmp_path: Path) -> None:
    accelerate = tmp_path / "accelerate.yaml"
    accelerate.write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n  fsdp_offload_params: true\n"
        "  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
    )
    settings = parse_fsdp(True, accelerate)
    assert settings.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer",)
    assert settings.cpu_offload and not settings.reshard_after_forward
    words = parse_fsdp("shard_grad_op offload auto_wrap", None)
    assert words.cpu_offload and not words.reshard_after_forward
    # the file wins over the flag words
    assert parse_fsdp("shard_grad_op", '{"reshard_after_forward": true}').reshard_after_forward
    assert parse_fsdp(True, {"min_num_params": 1000}).auto_wrap_policy == "size"
    assert FSDPSettings.from_dict(settings.to_dict()) == settings
    assert normalized_config(settings)["xla"] is False


@pytest.mark.parametrize(
    ("fsdp", "config", "message"),
    [
        (True, {"version": 1}, "FSDP1 is deprecated upstream"),
        (True, {"fsdp_version": "1"}, "trains with FSDP2"),
        (True, {"reshard_after_forwrd": True}, "Did you mean 'reshard_after_forward'"),
        (True, {"sharding_strategy": "NO_SHARD"}, "use DDP"),
        (True, {"auto_wrap_policy": "LAYER"}, "unknown auto_wrap_policy"),
        (True, {"xla": True}, "xla is not supported"),
        (True, {"cpu_offload": "maybe"}, "must be true or false"),
        (True, {"param_dtype": "int8"}, "param_dtype must be one of"),
        ("full_shard sharded", None, "unknown option 'sharded'"),
        (True, "missing.yaml", "no such file"),
    ],
)
def test_bad_settings_say_what_to_change(fsdp, config, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_fsdp(fsdp, config)


def test_ignored_fsdp1_keys_are_named(caplog: pytest.LogCaptureFixture) -> None:
    parse_fsdp(True, {"backward_prefetch": "BACKWARD_PRE", "use_orig_params": True})
    assert "ignoring backward_prefetch, use_orig_params" in caplog.text


def test_wrap_units_by_layer_class_by_size_and_unknown_class() -> None:
    model, state = tiny_llama(0), DistState(cpu=True)
    units = FSDPStrategy(state).wrap_targets(model)  # default: the model's _no_split_modules
    assert [type(m).__name__ for m in units] == ["LlamaDecoderLayer"] * 2
    by_size = FSDPStrategy(state, {"auto_wrap_policy": "size", "min_num_params": 5000}).wrap_targets(model)
    assert by_size and all(sum(p.numel() for p in m.parameters()) >= 5000 for m in by_size)
    with pytest.raises(ConfigError, match="does not contain; its layer classes are: .*LlamaDecoderLayer"):
        FSDPStrategy(state, {"transformer_layer_cls_to_wrap": ["GPT2Block"]}).wrap_targets(model)
    assert "LlamaMLP" in layer_classes(model)


def test_trainable_leaves_get_units_of_their_own_only_where_a_unit_would_mix() -> None:
    """Frozen base + trainable q_proj (LoRA's shape): each trainable leaf becomes a unit, so no unit mixes;
    an all-trainable or all-frozen model keeps exactly its layer units."""
    model, state = tiny_llama(0), DistState(cpu=True)
    targets = FSDPStrategy(state).wrap_targets(model)
    assert trainable_islands(model, targets) == []  # all trainable: unchanged
    for name, p in model.named_parameters():
        p.requires_grad_("q_proj" in name)
    islands = trainable_islands(model, targets)
    assert {id(m) for m in islands} == {id(layer.self_attn.q_proj) for layer in model.model.layers}
    assert trainable_islands(model, []) and len(trainable_islands(model, [])) == 2  # one unit (the root) mixes too
    units = [*islands, *targets, model]
    covered: set[int] = set()
    for unit in units:  # what each unit manages: its parameters not in an earlier (inner) unit
        own = [p for p in unit.parameters() if id(p) not in covered]
        covered |= {id(p) for p in own}
        assert len({p.requires_grad for p in own}) == 1, type(unit).__name__
    for p in model.parameters():
        p.requires_grad_(False)
    assert trainable_islands(model, targets) == []


def test_checkpointed_layers_give_the_same_gradients() -> None:
    plain, checkpointed = tiny_llama(0), tiny_llama(0)
    for layer in checkpointed.model.layers:
        checkpoint_forward(layer)
    batch = lm_dataset(2)[:]
    ids = torch.tensor(batch["input_ids"])
    for model in (plain, checkpointed):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_fsdp_excludes_deepspeed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="choose one"):
        TrainingArguments(output_dir=str(tmp_path), fsdp=True, deepspeed="zero3.json", use_cpu=True)


def test_cli_bad_fsdp_config_exits_2(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config = tmp_path / "fsdp.yaml"
    config.write_text("version: 1\n")
    out = tmp_path / "out"
    code = main(["train", "--output_dir", str(out), "--fsdp", "--fsdp_config", str(config)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "FSDP2" in err and "Traceback" not in err
    assert not out.exists()


def test_sharded_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint-2"
    dcp.save(tiny_llama(0).state_dict(), checkpoint_id=str(checkpoint / sharded_checkpoint.MODEL_DIR), no_dist=True)
    other = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with pytest.raises(ConfigError, match="holds another model: .*missing tensors"):
        sharded_checkpoint.check_model_matches(other, checkpoint)
    trainer = Trainer(model=other, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"))
    with pytest.raises(ConfigError, match="refusing to resume|holds another model"):
        trainer.resolve_resume(str(checkpoint))
    # the right model loads it, whole, on one process
    model = tiny_llama(1)
    sharded_checkpoint.load_model(model, checkpoint)
    expected = tiny_llama(0).state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items())


def test_mixed_precision_policy_follows_bf16_fp16_and_the_config() -> None:
    state = DistState(cpu=True)
    bf16 = FSDPStrategy(state, mixed_precision="bf16").mp_policy()
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp16 = FSDPStrategy(state, mixed_precision="fp16").mp_policy()
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float32)
    full = FSDPStrategy(state).mp_policy()
    assert (full.param_dtype, full.reduce_dtype) == (None, None)
    custom = FSDPStrategy(state, {"reduce_dtype": "bfloat16"}, mixed_precision="bf16").mp_policy()
    assert custom.reduce_dtype == torch.bfloat16
