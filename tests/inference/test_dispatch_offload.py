"""CPU + disk offload on the CPU: the dispatched model must compute exactly what the original computes."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

from tests.inference.dispatch_models import make_gpt2, make_llama, prompt
from trainer_ext.errors import ConfigError
from trainer_ext.inference import dispatch_model, dispatch_summary, remove_hooks, send_to_device
from trainer_ext.inference.hooks import DispatchHook, Fetch, Resident
from trainer_ext.inference.inventory import Slot


def _greedy(model: nn.Module, ids: torch.Tensor, **kwargs):
    return model.generate(
        ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True, **kwargs
    )


@pytest.fixture
def pair(tmp_path):
    """(reference, dispatched) tied Llamas: embedding and head in RAM, the decoder layers on disk."""
    reference = make_llama()
    model = dispatch_model(
        copy.deepcopy(reference), max_memory={"cpu": "200KB"}, offload_dir=tmp_path, print_summary=False
    )
    return reference, model


def test_cpu_and_disk_forward_is_identical(pair, tmp_path) -> None:
    reference, model = pair
    assert model.hf_device_map == {
        "model.embed_tokens": "cpu",
        "model.layers": "disk",
        "model.norm": "disk",
        "model.rotary_emb": "disk",
        "lm_head": "cpu",
    }
    ids = prompt()
    with torch.no_grad():
        expected, got = reference(ids), model(ids)
    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got.past_key_values.layers[3].keys, expected.past_key_values.layers[3].keys)


@pytest.mark.compat
def test_greedy_generation_is_identical(pair) -> None:
    reference, model = pair
    ids = prompt()
    expected, got = _greedy(reference, ids), _greedy(model, ids)
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores, strict=True))
    no_cache = _greedy(model, ids, use_cache=False)
    assert torch.equal(no_cache.sequences, expected.sequences)


def test_disk_weights_are_files_loaded_only_during_forward(pair, tmp_path) -> None:
    _, model = pair
    index = json.loads((tmp_path / "index.json").read_text())["weight_map"]
    assert index["model.layers.2.mlp.up_proj.weight"] == "model.layers.safetensors"
    assert os.path.isfile(tmp_path / "model.layers.safetensors") and os.path.isfile(
        tmp_path / "model.norm.safetensors"
    )
    up = model.model.layers[2].mlp.up_proj
    assert up.weight.device.type == "meta" and model.model.embed_tokens.weight.device.type == "cpu"
    seen = []
    up.register_forward_pre_hook(lambda module, args: seen.append(module.weight.device.type))  # runs after ours
    with torch.no_grad():
        model(prompt())
    assert seen == ["cpu"]  # real inside its forward
    assert up.weight.device.type == "meta"  # and released after
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_gpt2_all_layers_on_disk(tmp_path) -> None:
    reference = make_gpt2()
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "disk", "transformer.h": "disk", "": "disk"}
    model = dispatch_model(copy.deepcopy(reference), device_map, offload_dir=tmp_path, print_summary=False)
    ids = prompt(length=6)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert torch.equal(_greedy(model, ids).sequences, _greedy(reference, ids).sequences)
    # the head shares the embedding matrix, which stays in RAM: it is not written to disk
    assert "lm_head.weight" not in json.loads((tmp_path / "index.json").read_text())["weight_map"]
    assert model.lm_head.weight is model.transformer.wte.weight


def test_encoder_decoder_generation(tmp_path) -> None:
    """transformers' generate puts an io_same_device hook on the encoder; ours must take its place."""
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        eos_token_id=1,
    )
    reference = T5ForConditionalGeneration(config).eval()
    device_map = {"shared": "cpu", "encoder": "disk", "decoder": "disk", "lm_head": "cpu"}
    model = dispatch_model(copy.deepcopy(reference), device_map, offload_dir=tmp_path, print_summary=False)
    assert isinstance(model.encoder._hf_hook, DispatchHook)
    ids = prompt(length=7)
    assert torch.equal(_greedy(model, ids).sequences, _greedy(reference, ids).sequences)


def test_summary_is_printed(tmp_path, capsys) -> None:
    dispatch_model(make_llama(layers=6), max_memory={"cpu": "400KB"}, offload_dir=tmp_path)
    out = capsys.readouterr().out
    assert "trainer_ext dispatch: LlamaForCausalLM" in out
    lines = {line.split()[0]: line for line in out.splitlines()[2:4]}
    assert "model.embed_tokens, model.layers.0-1, lm_head" in lines["cpu"] and "390.6 KiB" in lines["cpu"]
    assert "model.layers.2-5, model.norm, model.rotary_emb" in lines["disk"]
    assert f"memory-mapped safetensors in {tmp_path}" in out


def test_summary_of_a_plain_model() -> None:
    assert dispatch_summary(make_llama()) == "LlamaForCausalLM is not dispatched"


def test_disk_without_offload_dir_is_refused() -> None:
    with pytest.raises(ConfigError, match="puts .* tensors on 'disk' but no offload_dir was given"):
        dispatch_model(make_llama(), {"": "disk"})


def test_dispatching_twice_is_refused_and_hooks_can_be_removed(tmp_path) -> None:
    model = dispatch_model(make_llama(), {"": "cpu"}, print_summary=False)
    with pytest.raises(ConfigError, match="already dispatched"):
        dispatch_model(model, {"": "cpu"})
    remove_hooks(model)
    dispatch_model(model, {"": "cpu"}, print_summary=False)


def test_weights_on_meta_are_refused() -> None:
    with torch.device("meta"):
        model = make_llama()
    with pytest.raises(ConfigError, match="on the meta device.*load_checkpoint_and_dispatch"):
        dispatch_model(model, {"": "cpu"})


def test_hook_fetches_and_releases_even_when_forward_raises() -> None:
    layer = nn.Linear(2, 2)
    stored = layer.weight.detach().clone()
    placeholder = nn.Parameter(torch.empty(2, 2, device="meta"))
    layer.weight = placeholder
    hook = DispatchHook(
        fetches=[Fetch(Slot("", layer, "weight", True), Resident(stored), torch.device("cpu"), placeholder)]
    )
    hook.attach(layer)
    assert torch.equal(layer(torch.eye(2)), torch.eye(2) @ stored.T + layer.bias)
    assert layer.weight is placeholder
    with pytest.raises(RuntimeError):
        layer(torch.ones(3, 3))
    assert layer.weight is placeholder


def test_send_to_device_keeps_structure_and_non_tensors() -> None:
    from collections import namedtuple

    pair = namedtuple("pair", "a b")
    marker = object()
    moved = send_to_device(
        {"x": [torch.ones(1), (torch.zeros(1), marker)], "p": pair(torch.ones(1), 3)}, torch.device("meta")
    )
    assert moved["x"][0].device.type == "meta" and moved["x"][1][1] is marker
    assert isinstance(moved["p"], pair) and moved["p"].a.device.type == "meta" and moved["p"].b == 3
    skipped = send_to_device({"past_key_values": torch.ones(1)}, torch.device("meta"), skip_keys={"past_key_values"})
    assert skipped["past_key_values"].device.type == "cpu"


def test_copies_made_for_a_forward_are_released(tmp_path) -> None:
    """Weights cast on load (here to bf16) are a copy per forward; nothing may keep that copy alive."""
    import gc
    import weakref

    from trainer_ext.inference import load_checkpoint_and_dispatch

    make_llama().save_pretrained(tmp_path)
    model = load_checkpoint_and_dispatch(
        type(make_llama()), tmp_path, {"": "disk"}, dtype=torch.bfloat16, print_summary=False
    )
    up = model.model.layers[0].mlp.up_proj
    seen = []
    up.register_forward_pre_hook(lambda module, args: seen.append(weakref.ref(module.weight)))
    with torch.no_grad():
        model(prompt())
    gc.collect()
    assert len(seen) == 1 and seen[0]() is None
    assert up.weight.device.type == "meta" and up.weight.dtype == torch.bfloat16
