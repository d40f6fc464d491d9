"""Reading a model's tensor-parallel plan and mapping transformers' style names onto torch's, in one process:
the plan's names from the root, the resolved module names, each style's torch class and layouts, the total gradient
norm of plain tensors, and every refusal (one line naming the numbers or the style)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tests.distributed.tensor_parallel_job import tiny_model
from trainer_ext.distributed.mesh.grad_norm import clip_grad_norm, total_grad_norm
from trainer_ext.distributed.mesh.tensor_parallel import (
    STYLES,
    check_divisible,
    check_styles,
    is_tensor_parallel,
    model_tp_plan,
    resolve_plan,
    torch_style,
)
from trainer_ext.errors import ConfigError

LAYER = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_model_plan_from_the_root(arch: str) -> None:
    model = tiny_model(arch)
    plan = model_tp_plan(model)
    expected = {f"model.layers.*.{key}": style for key, style in LAYER.items()}
    assert plan == {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output", **expected}
    # without transformers' merged instance plan: the class _tp_plan and the config's base plan under "model."
    del model.__dict__["_tp_plan"]
    assert model_tp_plan(model) == {"lm_head": "colwise_gather_output", **expected}
    resolved = resolve_plan(model, plan, strict=True)
    assert resolved == {
        "model.embed_tokens": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
        **{f"model.layers.{i}.{key}": style for i in range(2) for key, style in LAYER.items()},
    }


@pytest.mark.parametrize(
    ("style", "cls", "input_layout", "output_layout"),
    [
        ("colwise", ColwiseParallel, Replicate(), Shard(-1)),
        ("colwise_rep", ColwiseParallel, Replicate(), Replicate()),
        ("colwise_gather_output", ColwiseParallel, Replicate(), Replicate()),
        ("rowwise", RowwiseParallel, Shard(-1), Replicate()),
        ("rowwise_rep", RowwiseParallel, Replicate(), Replicate()),
        ("rowwise_split_input", RowwiseParallel, Replicate(), Replicate()),
        ("embedding_rowwise", RowwiseParallel, Replicate(), Replicate()),
        ("embedding_colwise", ColwiseParallel, Replicate(), Replicate()),
    ],
)
def test_each_style_maps_to_torch(style: str, cls: type, input_layout: object, output_layout: object) -> None:
    mapped = torch_style(style)
    assert type(mapped) is cls
    assert tuple(mapped.input_layouts) == (input_layout,)
    assert tuple(mapped.output_layouts) == (output_layout,)


def test_replicate_leaves_the_module_alone() -> None:
    assert torch_style("replicate") is None
    check_divisible(tiny_model("llama"), {"model.norm": "replicate"}, 2)


def test_every_other_transformers_style_is_refused_by_name() -> None:
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    others = sorted(set(ALL_PARALLEL_STYLES.keys()) - set(STYLES))
    assert "sequence_parallel" in others and "packed_colwise" in others
    for style in others:
        with pytest.raises(ConfigError, match=rf"^tensor-parallel plan entry 'x' asks for style '{style}'"):
            check_styles({"x": style})


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3),
            r"num_attention_heads \(3\) divisible by 2",
        ),
        (dict(num_key_value_heads=1), r"num_key_value_heads \(1\) divisible by 2"),
        (dict(intermediate_size=127), r"intermediate_size \(127\) divisible by 2"),
        (dict(vocab_size=127), r"model.embed_tokens.num_embeddings \(127\) divisible by 2"),
    ],
)
def test_sizes_the_ranks_cannot_split_are_refused(sizes: dict, message: str) -> None:
    model = tiny_model("llama", **sizes)
    with pytest.raises(ConfigError, match=rf"^tensor parallelism over 2 ranks needs {message}: choose a tp_size"):
        check_divisible(model, resolve_plan(model, model_tp_plan(model), strict=False), 2)


def test_heads_are_checked_only_where_the_plan_splits_them() -> None:
    model = tiny_model("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    check_divisible(model, resolve_plan(model, {"model.layers.*.mlp.down_proj": "rowwise"}, strict=True), 2)
    attention = {key: style for key, style in model_tp_plan(model).items() if "self_attn" in key}
    check_divisible(model, resolve_plan(model, attention, strict=True), 3)


def test_a_style_on_the_wrong_kind_of_module_is_refused() -> None:
    model = tiny_model("llama")
    resolved = resolve_plan(model, {"model.norm": "colwise"}, strict=True)
    with pytest.raises(ConfigError, match=r"^tensor-parallel style 'colwise' on 'model.norm' needs an nn.Linear"):
        check_divisible(model, resolved, 2)


def test_a_user_plan_entry_must_name_a_module() -> None:
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match=r"^tensor-parallel plan entry 'layers.\*.mlp.up_proj' names no module"):
        resolve_plan(model, {"layers.*.mlp.up_proj": "colwise"}, strict=True)
    assert resolve_plan(model, {"layers.*.mlp.up_proj": "colwise"}, strict=False) == {}


def test_a_model_loaded_tensor_parallel_is_recognised() -> None:
    model = tiny_model("llama")
    assert not is_tensor_parallel(model)
    model._tp_size = 2
    assert is_tensor_parallel(model)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_plain_tensors_norm_and_clip_as_torch(norm_type: float) -> None:
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn(a.shape)
        b.grad = a.grad.clone()
    assert total_grad_norm(ours, norm_type).item() == pytest.approx(
        torch.nn.utils.get_total_norm([p.grad for p in theirs], norm_type).item(), rel=1e-6
    )
    got = clip_grad_norm(ours, 0.5, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    assert total_grad_norm([torch.nn.Parameter(torch.ones(2))]).item() == 0.0
