"""Tier 1: collectives in one process (no process group) are identities with the documented shapes."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from trainer_ext.distributed import collectives as C

Pair = namedtuple("Pair", ["left", "right"])


def test_gather_scalar_becomes_1d() -> None:
    out = C.gather(torch.tensor(3.5))
    assert out.shape == (1,) and out.tolist() == [3.5]


def test_gather_nested() -> None:
    data = {"a": torch.tensor(1), "b": [torch.arange(3), torch.ones(2, 2)]}
    out = C.gather(data)
    assert out["a"].tolist() == [1]
    assert out["b"][0].tolist() == [0, 1, 2]
    assert out["b"][1].shape == (2, 2)


@pytest.mark.parametrize("obj", ["x", [1, 2], {"k": 1}])
def test_gather_object_is_the_identity_on_one_process(obj: object) -> None:
    assert C.gather_object(obj) is obj


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_reduce_single_process(reduction: str, scale: float) -> None:
    t = torch.tensor([1.0, -2.0, 4.0])
    out = C.reduce({"x": t}, reduction, scale)
    assert out["x"].tolist() == [1.0 * scale, -2.0 * scale, 4.0 * scale]
    assert out["x"] is not t
    out["x"].add_(1)
    assert t.tolist() == [1.0, -2.0, 4.0]  # the input is never modified


def test_reduce_rejects_unknown_reduction() -> None:
    with pytest.raises(ValueError, match="'sum' or 'mean'"):
        C.reduce(torch.ones(1), "max")


@pytest.mark.parametrize("dim", [0, 1, -1, 5])
@pytest.mark.parametrize("pad_first", [False, True])
def test_pad_across_processes_is_identity(dim: int, pad_first: bool) -> None:
    t = torch.arange(6).reshape(2, 3)
    s = torch.tensor(2)
    out = C.pad_across_processes([t, s], dim=dim, pad_index=-1, pad_first=pad_first)
    assert out[0] is t and out[1] is s


def test_broadcast_single_process() -> None:
    t = torch.arange(3)
    assert C.broadcast(t) is t
    objs = [1, "a"]
    assert C.broadcast_object_list(objs) is objs and objs == [1, "a"]


@pytest.mark.parametrize(
    "data, rows, expected",
    [
        (torch.arange(10), 3, [0, 1, 2]),
        (torch.arange(12).reshape(6, 2), 2, [[0, 1], [2, 3]]),
        (list("abcdef"), 4, list("abcd")),
        (torch.arange(3), 5, [0, 1, 2]),
    ],
)
def test_truncate_rows(data: object, rows: int, expected: list) -> None:
    out = C.truncate_rows(data, rows)
    assert (out.tolist() if isinstance(out, torch.Tensor) else out) == expected


def test_truncate_rows_nested() -> None:
    out = C.truncate_rows({"a": torch.arange(5), "b": (torch.arange(5) * 2, "keep")}, 2)
    assert out["a"].tolist() == [0, 1]
    assert out["b"][0].tolist() == [0, 2] and out["b"][1] == "keep"
    tensors = C.truncate_rows([torch.arange(4), torch.arange(4)], 1)  # a list of tensors: each one cut
    assert [t.tolist() for t in tensors] == [[0], [0]]


def test_send_to_device_moves_every_tensor_and_keeps_the_rest() -> None:
    data = {
        "x": torch.ones(2),
        "nested": [torch.zeros(1, dtype=torch.long), 3, "s"],
        "pair": Pair(torch.ones(1), None),
    }
    out = C.send_to_device(data, torch.device("meta"))
    assert out["x"].device.type == "meta" and out["x"].shape == (2,)
    assert out["nested"][0].device.type == "meta" and out["nested"][0].dtype == torch.long
    assert out["nested"][1:] == [3, "s"]
    assert isinstance(out["pair"], Pair) and out["pair"].left.device.type == "meta" and out["pair"].right is None
    assert data["x"].device.type == "cpu"  # the input structure is not modified
    cpu = C.send_to_device(data, torch.device("cpu"))
    assert cpu["x"].device == torch.device("cpu") and cpu["x"].tolist() == [1.0, 1.0]


def test_recursively_apply_keeps_container_types() -> None:
    def double(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    data = {
        "tuple": (torch.tensor(1), torch.tensor(2)),
        "list": [torch.tensor(3)],
        "pair": Pair(torch.tensor(4), [torch.tensor(5)]),
        "ordered": OrderedDict(b=torch.tensor(6), a=torch.tensor(7)),
        "other": "text",
        "none": None,
    }
    out = C.recursively_apply(double, data)
    assert type(out) is dict and list(out) == list(data)
    assert type(out["tuple"]) is tuple and [t.item() for t in out["tuple"]] == [2, 4]
    assert type(out["list"]) is list and out["list"][0].item() == 6
    assert type(out["pair"]) is Pair and out["pair"].left.item() == 8 and out["pair"].right[0].item() == 10
    assert type(out["ordered"]) is OrderedDict and list(out["ordered"]) == ["b", "a"]
    assert [t.item() for t in out["ordered"].values()] == [12, 14]
    assert out["other"] == "text" and out["none"] is None
    assert data["tuple"][0].item() == 1  # input untouched


def test_recursively_apply_model_output() -> None:
    out = C.recursively_apply(lambda t: t + 1, CausalLMOutputWithPast(loss=torch.tensor(0.0), logits=torch.zeros(2)))
    assert type(out) is CausalLMOutputWithPast
    assert out.loss.item() == 1.0 and out.logits.tolist() == [1.0, 1.0]
    assert out["logits"] is out.logits and out.past_key_values is None


def test_gathers_on_a_group_started_with_no_backend_named(tmp_path) -> None:  # noqa: ANN001
    """2 real ranks: views carrying gradients gather (not "a view was created in no_grad mode ..."), in both forms,
    on the group transformers starts under TRL's parser."""
    import json

    from tests.helpers.ranks import run_ranks

    out = tmp_path / "gathered.json"
    run_ranks("tests.distributed.unnamed_backend_gather_job", 2, str(out))
    got = json.loads(out.read_text())
    chosen = [[0.0, 2.0], [4.0, 6.0], [200.0, 202.0], [204.0, 206.0]]
    assert got["gather"] == chosen
    assert got["gather_forms"] == [chosen, chosen]
    assert got["gather_for_metrics"] == [9.0, 13.0, 209.0, 213.0]
    assert got["needs_grad"] is False
    assert got["padded"] == [[0.0, 2.0], [0.0, 0.0]]
    assert got["grad"] == [[2.0, 2.0]] * 4
