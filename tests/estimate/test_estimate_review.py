"""Review fixes: start-up estimates under FSDP and ZeRO-3, optimizer states, hybrid sharding, ZeRO-0 master
weights, the batch remedy's label, --json paths, the flag combinations train refuses, LoRA without peft."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers

from trainer_ext.cli.main import main
from trainer_ext.errors import ConfigError
from trainer_ext.estimate import ModelShape, Setup, estimate
from trainer_ext.estimate.breakdown import optimizer_state
from trainer_ext.estimate.fit import largest_batch, remedies, smaller_batch
from trainer_ext.estimate.setup import setup_from_values
from trainer_ext.estimate.startup import device_memory_bytes
from trainer_ext.job.flags import parse_train_args
from trainer_ext.values import parse_size

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAUSAL = ["--model_config", "tiny-llama", "--task", "causal-lm"]


def _tiny_llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2
    )
    return transformers.LlamaForCausalLM(config)


def _refused(capsys, *argv: str) -> str:
    """``trainer-ext estimate ARGV`` exits 2 with one error line and no traceback."""
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# --- 1, 2: the start-up estimate of real 2-rank FSDP and ZeRO-3 runs ------------------------------------------------


def _startup_block(tmp_path, *flags: str) -> dict[str, int]:
    """Launch 2 CPU ranks for 2 steps; the bytes of the start-up block's rows (it must be there)."""
    cmd = [sys.executable, "-m", "trainer_ext", "launch", "--num_processes", "2", "--cpu", "train", *CAUSAL]
    cmd += ["--max_steps", "2", "--report_plots", "false", "--save_strategy", "no", "--save_final_model", "false"]
    cmd += ["--output_dir", str(tmp_path / "out"), *flags]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "***** trainer_ext: memory estimate per rank *****" in output, output[-3000:]
    block = output.split("***** trainer_ext: memory estimate per rank *****")[1].splitlines()[1:9]
    rows: dict = {}
    for line in block:
        found = re.fullmatch(r"\s*(weights|gradients|optimizer states|activations|total)\s+([\d.]+) (\w+)\s*", line)
        if found:
            rows[found[1]] = parse_size(found[2] + found[3], found[1])
    rows["describe"] = block[0]
    return rows


@pytest.fixture(scope="module")
def ddp_block(tmp_path_factory) -> dict:
    return _startup_block(tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_fsdp_run_prints_the_startup_estimate(tmp_path, ddp_block) -> None:
    rows = _startup_block(tmp_path, "--fsdp", "full_shard")
    assert "FSDP2 full_shard on 2 processes" in rows["describe"]
    for label in ("weights", "gradients", "optimizer states"):
        assert rows[label] == pytest.approx(ddp_block[label] / 2, rel=0.01), label  # 2 shards
    assert rows["activations"] == ddp_block["activations"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(600)
def test_zero3_startup_estimate_counts_the_partitioned_model(tmp_path, ddp_block) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    rows = _startup_block(tmp_path, "--deepspeed", "configs/deepspeed/zero3.json")
    assert "DeepSpeed ZeRO-3 on 2 processes" in rows["describe"]
    # fp32 ZeRO-3 holds P/2 of each state, and at the step an fp32 master partition beside the parameters' and an
    # fp32 copy of the gradient partition beside the reduced one: twice P/2
    for label, copies in (("weights", 2), ("gradients", 2), ("optimizer states", 1)):
        assert rows[label] > 0, label
        assert rows[label] == pytest.approx(copies * ddp_block[label] / 2, rel=0.01), label


def test_shape_counts_zero3_partitioned_parameters_with_ds_numel() -> None:
    model = _tiny_llama()
    full = ModelShape.from_model(model)
    for p in model.parameters():  # what deepspeed.zero.Init leaves: an empty tensor, the full count on the side
        p.ds_numel, p.ds_shape = p.numel(), p.shape
        p.data = torch.empty(0)
    partitioned = ModelShape.from_model(model)
    assert partitioned.params == full.params > 0
    assert partitioned.layer_params == full.layer_params > 0
    assert partitioned.factored_trainable == full.factored_trainable > 0


# --- 4: optimizer states against a real optimizer after one step -----------------------------------------------------


@pytest.mark.parametrize(
    ("optim", "optim_args"),
    [("adamw_torch", None), ("sgd", None), ("sgd", "momentum=0.9"), ("adafactor", None), ("rmsprop", None)],
)
def test_optimizer_states_match_a_real_step(tmp_path, optim: str, optim_args: str | None) -> None:
    model = _tiny_llama()
    extra = ["--optim_args", optim_args] if optim_args else []
    args = parse_train_args([*CAUSAL, "--output_dir", str(tmp_path), "--optim", optim, *extra])
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = cls(model.parameters(), **kwargs)
    ids = torch.randint(0, 96, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    real = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0  # step counters and Adafactor's RMS are scalars
    )
    setup = setup_from_values({"optim": optim, "optim_args": optim_args}, 1, 16)
    estimated = optimizer_state(ModelShape.from_model(model), setup)
    assert estimated == real, (optim, optim_args, estimated, real)
    assert estimate(ModelShape.from_model(model), setup).optimizer == real


# --- 5, 6: hybrid sharding, ZeRO-0 master weights --------------------------------------------------------------------


def _shape(**changes) -> ModelShape:
    values = dict(
        model_type="llama", params=1_000_000, trainable=1_000_000, layer_params=200_000, num_layers=4, hidden=64,
        intermediate=128, heads=4, kv_heads=4, vocab=1000, causal_lm=True,
    )  # fmt: skip
    return ModelShape(**{**values, **changes})


def test_hybrid_shard_shards_over_world_size_over_replicate_size() -> None:
    shape = _shape()
    full = setup_from_values({"fsdp": "full_shard"}, 8, 128)
    hybrid = setup_from_values({"fsdp": "hybrid_shard", "fsdp_config": {"replicate_size": 2}}, 8, 128)
    assert (full.shards, hybrid.shards) == (8, 4)
    assert estimate(shape, hybrid).weights == 4 * shape.params // 4
    assert estimate(shape, full).weights == 4 * shape.params // 8
    assert "2 replicas of 4 shards" in hybrid.describe()
    with pytest.raises(ConfigError, match="does not divide"):
        setup_from_values({"fsdp": "hybrid_shard", "fsdp_config": {"replicate_size": 3}}, 8, 128)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero0_mixed_precision_keeps_a_whole_fp32_master_copy(tmp_path, precision: str) -> None:
    config = tmp_path / "zero0.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 0}, precision: {"enabled": True}}))
    setup = setup_from_values({"deepspeed": str(config)}, 2, 128)
    assert (setup.zero_stage, setup.precision) == (0, precision)
    shape = _shape()
    assert estimate(shape, setup).weights == 2 * shape.params + 4 * shape.params  # model in 16 bit + fp32 master
    fp32 = setup.replace(precision="no")
    assert estimate(shape, fp32).weights == 4 * shape.params


# --- 7: the batch remedy says when the global batch changes ----------------------------------------------------------


def test_smaller_batch_keeps_the_global_batch_when_a_divisor_fits() -> None:
    flags, changed = smaller_batch(Setup(micro_batch=8, accumulation=3), 3)
    assert (changed.micro_batch, changed.accumulation) == (3, 8) and "(same global batch)" in flags
    flags, changed = smaller_batch(Setup(micro_batch=8, accumulation=1), 3)
    assert (changed.micro_batch, changed.accumulation) == (2, 4) and "(same global batch)" in flags
    flags, changed = smaller_batch(Setup(micro_batch=7, accumulation=1), 3)
    assert (changed.micro_batch, changed.accumulation) == (3, 3)
    assert "(global batch changes: 9 instead of 7 examples per rank per step)" in flags and "same" not in flags


@pytest.mark.parametrize("micro_batch", [7, 12, 13])
def test_a_remedy_labelled_same_global_batch_keeps_it(micro_batch: int) -> None:
    shape, setup = _shape(), Setup(micro_batch=micro_batch, seq_len=256)
    full = estimate(shape, setup).peak
    for fraction in (0.3, 0.45, 0.6, 0.8, 0.9):
        limit = int(full * fraction)
        if not 0 < largest_batch(shape, setup, limit) < micro_batch:
            continue
        remedy = next(r for r in remedies(shape, setup, limit) if r.flags.startswith("--per_device_train_batch_size"))
        words = remedy.flags.split()
        batch, accumulation = int(words[1]), int(words[3])
        assert ("(same global batch)" in remedy.flags) == (batch * accumulation == micro_batch), remedy.flags
        assert batch * accumulation >= micro_batch


# --- 8, 9, 10: errors up front ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("measure", [[], ["--measure"]])
def test_json_into_a_missing_folder_is_refused_before_anything_runs(capsys, measure) -> None:
    err = _refused(capsys, *CAUSAL, *measure, "--json", "/nonexistent/dir/x.json")
    assert "folder '/nonexistent/dir' does not exist" in err


def test_json_naming_a_folder_is_refused(tmp_path, capsys) -> None:
    assert "is a folder" in _refused(capsys, *CAUSAL, "--json", str(tmp_path))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--num_processes", "2", "--fsdp", "full_shard", "--deepspeed", "configs/deepspeed/zero3.json"],
            "choose one",
        ),
        (["--fp16", "--bf16"], "both --fp16 and --bf16"),
        (["--fsdp", "full_shard", "--num_processes", "2", "--fsdp_config", '{"min_num_params": "big"}'], "whole"),
        (["--fp8", "--bf16"], "--fp8 already runs bf16"),
        (["--num_processes", "2", "--fsdp", "full_shard", "--auto_find_batch_size"], "--auto_find_batch_size"),
    ],
)
def test_combinations_train_refuses_are_refused(capsys, flags, message) -> None:
    assert message in _refused(capsys, *CAUSAL, *flags)


def test_fsdp_on_one_process_is_estimated_as_launched(capsys) -> None:
    """``trainer-ext launch --num_processes 1`` runs FSDP2 on one process (a 1-rank mesh): estimate it, not refuse."""
    assert main(["estimate", *CAUSAL, "--fsdp", "full_shard"]) == 0
    assert "FSDP2 full_shard on 1 process" in capsys.readouterr().out


def test_unknown_flags_read_as_train_reads_them(capsys) -> None:
    assert "unexpected argument 'foo'" in _refused(capsys, *CAUSAL, "foo")
    err = _refused(capsys, *CAUSAL, "--num_proceses", "2")
    assert "unknown flag --num_proceses. Did you mean --num_processes?" in err
    assert "(all flags: trainer-ext estimate --help)" in err


def test_device_memory_is_parsed_in_one_place(capsys) -> None:
    assert device_memory_bytes("1KiB") == 1024
    with pytest.raises(ConfigError, match="more than 0 bytes"):
        device_memory_bytes("0GiB")
    assert "more than 0 bytes" in _refused(capsys, *CAUSAL, "--device_memory", "0GB")


@pytest.mark.skipif(importlib.util.find_spec("peft") is not None, reason="peft is installed: tests/with_peft")
def test_lora_without_peft_is_one_error_line(capsys) -> None:
    assert "--lora_r needs peft" in _refused(capsys, *CAUSAL, "--lora_r", "8")


def test_adafactor_factored_elements() -> None:
    shape = ModelShape.from_model(_tiny_llama())
    assert 0 < shape.factored_trainable < shape.trainable / 4
    assert math.isclose(
        optimizer_state(shape, setup_from_values({"optim": "adafactor"}, 1, 16)), 4 * shape.factored_trainable
    )
