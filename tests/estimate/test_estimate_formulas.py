"""The formulas against real components: saved-tensor counts of real forwards, the fit search, sharding, bad input."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import transformers

from trainer_ext.cli.main import main
from trainer_ext.estimate import ModelShape, Setup, estimate
from trainer_ext.estimate.activations import MASK_BYTES, activation_bytes
from trainer_ext.estimate.fit import largest_batch, remedies
from trainer_ext.estimate.job import job_from_argv
from trainer_ext.estimate.measure import SavedTensors

# shapes the formula was not fitted on
CONFIGS = {
    "llama": dict(
        hidden_size=80, intermediate_size=200, num_attention_heads=5, num_key_value_heads=5, num_hidden_layers=3
    ),
    "gpt2": dict(n_embd=48, n_inner=160, n_head=3, n_layer=2),
    "bert": dict(
        hidden_size=48,
        intermediate_size=96,
        num_attention_heads=3,
        num_hidden_layers=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        is_decoder=True,
    ),
}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_activation_formula_matches_saved_tensors(model_type: str) -> None:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, vocab_size=300, **CONFIGS[model_type])
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    batch, seq = 3, 40
    ids = torch.randint(0, 300, (batch, seq))
    with SavedTensors() as saved:
        model(input_ids=ids, labels=ids)
    setup = Setup(micro_batch=batch, seq_len=seq)
    expected = activation_bytes(ModelShape.from_model(model), setup, batch, False) - MASK_BYTES * batch * seq * seq
    assert saved.total > 0
    assert abs(expected - saved.total) / saved.total < 0.05, (expected, saved.total)


def _shape(**changes) -> ModelShape:
    values = dict(
        model_type="llama",
        params=8_000_000_000,
        trainable=8_000_000_000,
        layer_params=218_000_000,
        num_layers=32,
        hidden=4096,
        intermediate=14336,
        heads=32,
        kv_heads=8,
        vocab=128256,
        causal_lm=True,
    )
    values.update(changes)
    return ModelShape(**values)


def test_sharding_factors_and_precision() -> None:
    shape = _shape()
    p = shape.params
    ddp = estimate(shape, Setup(strategy="ddp", world_size=8))
    assert (ddp.weights, ddp.gradients, ddp.optimizer) == (4 * p, 4 * p, 8 * p)
    fsdp = estimate(shape, Setup(strategy="fsdp", world_size=8))
    assert (fsdp.weights, fsdp.gradients, fsdp.optimizer) == (4 * p // 8, 4 * p // 8, 8 * p // 8)
    zero3 = estimate(shape, Setup(strategy="deepspeed", zero_stage=3, world_size=8, precision="bf16"))
    assert zero3.weights == int(2 * p / 8 + 4 * p / 8)  # bf16 partition + fp32 master partition
    offload = estimate(
        shape, Setup(strategy="deepspeed", zero_stage=3, world_size=8, offload_optimizer=True, offload_params=True)
    )
    assert offload.weights == offload.gradients == offload.optimizer == 0 and offload.offloaded > 0
    zero1 = estimate(shape, Setup(strategy="deepspeed", zero_stage=1, world_size=8, precision="bf16"))
    # whole bf16 gradients after backward, more than the partition and its fp32 copy in the step
    assert zero1.optimizer == 8 * p // 8 and zero1.gradients == 2 * p
    zero2 = estimate(shape, Setup(strategy="deepspeed", zero_stage=2, world_size=8, precision="bf16"))
    boundary = max(shape.vocab, shape.intermediate) * shape.hidden  # the largest tensor, held whole across an end
    assert zero2.gradients == int(2 * p / 8 + 4 * p / 8 + 2 * boundary)
    assert zero3.gradients == int(2 * p / 8 + 4 * shape.params / 8)  # p / 8 is within the default sub_group_size
    capped = estimate(shape, Setup(strategy="deepspeed", zero_stage=3, world_size=2, sub_group_size=10**9))
    assert capped.gradients == int(4 * p / 2 + 4 * 10**9)  # the fp32 copy of one sub-group at a time
    bf16 = estimate(shape, Setup(precision="bf16", micro_batch=1, seq_len=4096))
    fp32 = estimate(shape, Setup(micro_batch=1, seq_len=4096))
    logits = 4 * shape.vocab * 4096
    assert bf16.activations - logits == pytest.approx((fp32.activations - logits) / 2, rel=0.01)  # logits stay fp32
    assert fp32.activations_checkpointed < fp32.activations_full / 4


@pytest.mark.parametrize("memory", ["80GiB", "24GB", "200MiB"])
def test_largest_batch_is_the_boundary(memory: str) -> None:
    from trainer_ext.values import parse_size

    limit = parse_size(memory)
    for shape, setup in (
        (_shape(), Setup(strategy="fsdp", world_size=8, precision="bf16", seq_len=2048)),
        (
            _shape(
                params=80_000,
                trainable=80_000,
                layer_params=30_000,
                num_layers=2,
                hidden=64,
                intermediate=128,
                heads=4,
                kv_heads=2,
                vocab=91,
            ),
            Setup(seq_len=128),
        ),
    ):
        batch = largest_batch(shape, setup, limit)
        assert estimate(shape, setup, batch + 1).peak > limit
        if batch:
            assert estimate(shape, setup, batch).peak <= limit


def test_remedies_name_fitting_flags() -> None:
    shape = _shape(
        params=1_240_000_000,
        trainable=1_240_000_000,
        layer_params=60_000_000,
        num_layers=16,
        hidden=2048,
        intermediate=8192,
        heads=32,
        kv_heads=8,
    )
    setup = Setup(strategy="ddp", world_size=8, precision="bf16", seq_len=4096, micro_batch=16)
    limit = 80 * 2**30
    assert estimate(shape, setup).peak > limit
    found = remedies(shape, setup, limit)
    flags = " ".join(r.flags for r in found)
    for word in ("--per_device_train_batch_size", "--gradient_accumulation_steps", "checkpointing", "zero3"):
        assert word in flags
    assert any(r.fits for r in found) and all(r.fits == (r.peak <= limit) for r in found)


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_70b_config_estimates_in_seconds_on_the_meta_device(tmp_path) -> None:
    config = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=80,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    path = tmp_path / "llama70b.json"
    path.write_text(json.dumps(config))
    before, started = _rss(), time.perf_counter()
    job = job_from_argv(
        [
            "--task",
            "causal-lm",
            "--model_config",
            str(path),
            "--bf16",
            "--deepspeed",
            "configs/deepspeed/zero3.json",
            "--per_device_train_batch_size",
            "1",
        ],
        8,
    )
    seconds = time.perf_counter() - started
    assert seconds < 30
    assert _rss() - before < 2**30  # 70B fp32 would be 280 GB
    assert 6.8e10 < job.shape.params < 7.1e10 and job.shape.num_layers == 80
    result = estimate(job.shape, job.setup)
    assert job.setup.strategy == "deepspeed" and job.setup.zero_stage == 3 and job.setup.precision == "bf16"
    assert result.weights == int(6 * job.shape.params / 8)


def test_json_schema(tmp_path) -> None:
    out = tmp_path / "estimate.json"
    code = main(
        [
            "estimate",
            "--task",
            "causal-lm",
            "--model_config",
            "tiny-llama",
            "--num_processes",
            "2",
            "--device_memory",
            "64MiB",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    document = json.loads(out.read_text())
    assert set(document) >= {"estimated", "measured"} and document["measured"] is None
    estimated = document["estimated"]
    for key in ("weights", "gradients", "optimizer", "activations", "total"):
        assert isinstance(estimated[key], int) and estimated[key] > 0
    parts = sum(estimated[k] for k in ("weights", "gradients", "optimizer", "activations"))
    assert estimated["total"] == parts
    assert document["setup"]["world_size"] == 2 and document["setup"]["largest_batch"] > 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--num_processes", "0"], "between 1 and 1048576"),
        (["--model_config", "tiny-lama"], "tiny-llama"),
        (["--device_memory", "lots"], "cannot read"),
        (["--device_memory", "2G"], "ambiguous"),
        (["--device_memory", "0"], "more than 0"),
        (["--per_device_train_batch_size", "0"], "at least 1"),
        (["--no_such_flag", "1"], "unknown flag"),
    ],
)
def test_bad_input_exits_2(argv: list[str], words: str, capsys) -> None:
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and words in err and len(err.strip().splitlines()) == 1
