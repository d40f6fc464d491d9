"""The communication model per family against bytes derived by hand (each derivation in a comment), the ring
wire bytes, and the naming of a mesh's process groups."""

from __future__ import annotations

import pytest

from trainer_ext.estimate.setup import Setup
from trainer_ext.estimate.shape import ModelShape
from trainer_ext.plan.comms import Traffic, by_collective, dimension_groups, step_traffic, wire_bytes

# 4 decoder layers of 2,000 parameters (blocks 8,000) and 2,000 outside them (embeddings, norm, head)
PARAMS, LAYER, LAYERS = 10_000, 2_000, 4


def shape(**changes) -> ModelShape:
    values = dict(
        model_type="llama",
        params=PARAMS,
        trainable=PARAMS,
        layer_params=LAYER,
        num_layers=LAYERS,
        hidden=64,
        intermediate=128,
        heads=4,
        kv_heads=2,
        vocab=92,
        causal_lm=True,
    )
    return ModelShape(**{**values, **changes})


def table(traffic: list[Traffic]) -> dict[tuple[str, str, int], int]:
    return {(t.dimension, t.collective, t.group_size): t.bytes for t in traffic}


def test_one_process_communicates_nothing() -> None:
    assert step_traffic(shape(), Setup(strategy="single", world_size=1)) == []


def test_ddp_all_reduces_the_trainable_gradients_once_per_step() -> None:
    # 8,000 trainable fp32 gradients (autocast keeps fp32 parameters under --bf16) = 32,000 bytes; no_sync skips
    # the all-reduce on the window's first three micro-batches: once per step, over all 4 ranks
    setup = Setup(strategy="ddp", world_size=4, accumulation=4, precision="bf16")
    assert table(step_traffic(shape(trainable=8_000), setup)) == {("dp", "all_reduce", 4): 32_000}


def test_fsdp2_gathers_every_micro_batch_and_reduce_scatters_once() -> None:
    # full_shard: forward gathers all 10,000 parameters, backward the 8,000 of the layers again (the root stays
    # gathered): 18,000 x 4 bytes x 3 micro-batches = 216,000; the fp32 gradients reduce-scattered once: 40,000
    setup = Setup(strategy="fsdp", world_size=4, accumulation=3)
    assert table(step_traffic(shape(), setup)) == {
        ("dp", "all_gather", 4): 216_000,
        ("dp", "reduce_scatter", 4): 40_000,
    }


def test_fsdp2_shard_grad_op_under_bf16_gathers_once_in_bf16() -> None:
    # reshard_after_forward false: no backward gather; bf16 parameters: 10,000 x 2 bytes x 2 micro-batches = 40,000;
    # gradients reduced in fp32 (the mixed-precision policy's reduce dtype): 10,000 x 4 = 40,000
    setup = Setup(strategy="fsdp", world_size=2, accumulation=2, precision="bf16", reshard_after_forward=False)
    assert table(step_traffic(shape(), setup)) == {
        ("dp", "all_gather", 2): 40_000,
        ("dp", "reduce_scatter", 2): 40_000,
    }


def test_hsdp_all_reduces_the_shard_over_the_replicas() -> None:
    # 8 ranks = 2 replicas x 4 shards: gathers and reduce-scatter over dp_shard (4 ranks) as plain FSDP2, then each
    # rank's quarter of the fp32 gradients (10,000 / 4 x 4 bytes = 10,000) all-reduced over dp_replicate
    setup = Setup(strategy="fsdp", world_size=8, replicate=2)
    assert table(step_traffic(shape(), setup)) == {
        ("dp_replicate", "all_reduce", 2): 10_000,
        ("dp_shard", "all_gather", 4): 72_000,  # (10,000 + 8,000) x 4
        ("dp_shard", "reduce_scatter", 4): 40_000,
    }


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        # ZeRO-1 reduces once at the boundary, ZeRO-2 every micro-batch; both all-gather the updated bf16 parameters
        # (10,000 x 2 = 20,000) after the step
        (1, {("dp", "all_reduce", 4): 20_000, ("dp", "all_gather", 4): 20_000}),
        (2, {("dp", "all_reduce", 4): 40_000, ("dp", "all_gather", 4): 20_000}),
        # ZeRO-3: every forward gathers all parameters (backward reuses them: far within the reuse distance), every
        # backward reduce-scatters the bf16 gradients: 2 micro-batches x 20,000 each
        (3, {("dp", "all_gather", 4): 40_000, ("dp", "reduce_scatter", 4): 40_000}),
    ],
)
def test_deepspeed_zero_stages(stage: int, expected: dict) -> None:
    setup = Setup(strategy="deepspeed", world_size=4, zero_stage=stage, accumulation=2, precision="bf16")
    assert table(step_traffic(shape(), setup)) == expected


def test_zero3_gathers_again_in_backward_the_layers_beyond_the_reuse_distance() -> None:
    # 4 layers of 400M: layer i's forward and backward lie 2 x (3 - i) layers apart, 2.4e9 and 1.6e9 parameters for
    # layers 0 and 1 (over DeepSpeed's 1e9 reuse distance: gathered again), 0.8e9 and 0 for layers 2 and 3
    big = shape(params=1_600_002_000, trainable=1_600_002_000, layer_params=400_000_000)
    setup = Setup(strategy="deepspeed", world_size=2, zero_stage=3, precision="bf16")
    gathered = table(step_traffic(big, setup))[("dp", "all_gather", 2)]
    assert gathered == (1_600_002_000 + 2 * 400_000_000) * 2


def test_tensor_parallel_all_reduces_per_layer_and_gathers_the_logits() -> None:
    # micro-batch 2 x 64 tokens x hidden 64 x 4 bytes = 32,768 bytes per activation. Per layer: forward sums the
    # outputs of o_proj and down_proj (2), backward the input gradients of q, k, v, gate and up (5): 7 x 2 layers,
    # plus the vocabulary-split embedding's output and lm_head's input gradient: 16 x 32,768 = 524,288. The
    # logits gathered whole: 2 x 64 x 92 x 4 = 47,104. (A real run on 2 gloo ranks counted exactly these.)
    setup = Setup(strategy="ddp", world_size=2, tp_size=2, micro_batch=2, seq_len=64)
    assert table(step_traffic(shape(num_layers=2), setup)) == {
        ("tp", "all_reduce", 2): 524_288,
        ("tp", "all_gather", 2): 47_104,
    }
    # activation checkpointing runs each layer's forward again in backward: 2 more all-reduces per layer
    checkpointed = table(step_traffic(shape(num_layers=2), setup.replace(checkpointing=True)))
    assert checkpointed[("tp", "all_reduce", 2)] == 20 * 32_768
    # a fused qkv / up projection (gpt2's c_attn, c_fc): 2 column-parallel inputs per layer, not 5
    fused = table(step_traffic(shape(num_layers=2, model_type="gpt2"), setup))
    assert fused[("tp", "all_reduce", 2)] == (2 * 4 + 2) * 32_768


def test_tensor_parallel_with_fsdp2_gathers_each_ranks_slice() -> None:
    # the plan splits 8,000 parameters (1,600 of each layer) over 2 tp ranks: a rank holds 2,000 + 4,000 = 6,000
    # of them, 1,600 x 4 / 2 + 1,600 of its layers' 8,000 = 4,800; FSDP2 gathers those over dp_shard:
    # (6,000 + 4,800) x 4 = 43,200, and reduce-scatters 6,000 x 4 = 24,000
    tp_shape = shape(tp_params=8_000, tp_trainable=8_000, tp_layer_params=1_600)
    setup = Setup(strategy="fsdp", world_size=4, tp_size=2, micro_batch=1, seq_len=8)
    got = table(step_traffic(tp_shape, setup))
    assert got[("dp_shard", "all_gather", 2)] == 43_200
    assert got[("dp_shard", "reduce_scatter", 2)] == 24_000


def test_context_parallel_all_gather_backend() -> None:
    # 62 tokens padded to 64 (a multiple of 2 x cp). Per layer, keys and values gathered whole: 2 rows x 2 kv heads
    # x 64 x head_dim 16 x 4 bytes = 16,384 each, 2 layers: 65,536; positions (int64) and the padding mask (uint8)
    # gathered once per forward: 2 x 64 x 9 = 1,152; FSDP2 shards over the cp ranks (no dp_shard), so its gathers
    # (10,000 + 4,000 of the 2 layers) x 4 = 56,000 land on cp too. Backward all-reduces the keys' and values'
    # gradients: 65,536. (A real run counted these within 0.04 %.)
    setup = Setup(strategy="fsdp", world_size=2, cp_size=2, micro_batch=2, seq_len=62)
    assert table(step_traffic(shape(num_layers=2), setup)) == {
        ("cp", "all_gather", 2): 56_000 + 65_536 + 1_152,
        ("cp", "all_reduce", 2): 65_536,
        ("cp", "reduce_scatter", 2): 40_000,
    }


@pytest.mark.parametrize(
    ("schedule", "sends"),
    [
        ("1f1b", 1),  # rank 0 sends its stage's output forward, rank 1 its input gradient back: one each
        ("gpipe", 1),
        ("interleaved_1f1b", 3),  # stages 0, 2 | 1, 3: rank 0 sends 0→1, 2→3 and the gradient 2→1
        ("zbv_zero_bubble", 2),  # stages 0, 3 | 1, 2 (a V): 1→2 stays on rank 1, each rank sends twice
    ],
)
def test_pipeline_sends_per_microbatch_and_boundary(schedule: str, sends: int) -> None:
    # 6 rows padded to 8 for 4 microbatches: 2 rows x 32 tokens x hidden 64 x 4 bytes (the runtime sends float32)
    # = 16,384 bytes per send, x 4 microbatches x 2 accumulation steps
    setup = Setup(
        strategy="ddp",
        world_size=2,
        pp_size=2,
        pp_schedule=schedule,
        pp_microbatches=4,
        micro_batch=6,
        seq_len=32,
        accumulation=2,
    )
    got = table(step_traffic(shape(num_layers=8, params=18_000, trainable=18_000), setup))
    assert got == {("pp", "send_recv", 2): sends * 16_384 * 4 * 2}


def test_pipeline_middle_ranks_are_the_busiest() -> None:
    # pp 4, 1f1b: ranks 1 and 2 send forward and backward (2 sends per microbatch), the ends one
    setup = Setup(strategy="ddp", world_size=4, pp_size=4, pp_microbatches=4, micro_batch=4, seq_len=16)
    got = table(step_traffic(shape(num_layers=8, params=18_000, trainable=18_000), setup))
    assert got == {("pp", "send_recv", 4): 2 * 4 * (1 * 16 * 64 * 4)}


def test_wire_bytes_of_ring_algorithms() -> None:
    assert wire_bytes(Traffic("dp", "all_reduce", 4, 1000)) == 1500  # 2 (n - 1) / n
    assert wire_bytes(Traffic("dp", "all_gather", 4, 1000)) == 750  # (n - 1) / n
    assert wire_bytes(Traffic("dp", "reduce_scatter", 2, 1000)) == 500
    assert wire_bytes(Traffic("pp", "send_recv", 2, 1000)) == 1000
    assert wire_bytes(Traffic("pp", "broadcast", 8, 1000)) == 1000
    assert wire_bytes(Traffic("dp", "all_reduce", 1, 1000)) == 0


def test_by_collective_sums_over_dimensions() -> None:
    traffic = [Traffic("dp_shard", "all_gather", 2, 10), Traffic("tp", "all_gather", 2, 5)]
    assert by_collective(traffic) == {"all_gather": 15}


def test_dimension_groups_name_the_meshs_groups() -> None:
    # dp_shard 2 x tp 2, row-major: tp pairs neighbouring ranks, dp_shard strides over them
    assert dimension_groups(Setup(strategy="fsdp", world_size=4, tp_size=2)) == {
        (0, 1): "tp",
        (2, 3): "tp",
        (0, 2): "dp_shard",
        (1, 3): "dp_shard",
    }
    # dp_shard 2 x cp 2: FSDP2 shards over the flattened dp_shard_cp, all four ranks
    groups = dimension_groups(Setup(strategy="fsdp", world_size=4, cp_size=2))
    assert groups[(0, 1, 2, 3)] == "dp_shard_cp" and groups[(0, 1)] == "cp" and groups[(0, 2)] == "dp_shard"
    # no mesh: the whole world is the data-parallel group
    assert dimension_groups(Setup(strategy="ddp", world_size=3)) == {(0, 1, 2): "dp"}
