"""load_checkpoint_and_dispatch: built on meta, each weight read straight to its place, same outputs."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from tests.inference.dispatch_models import llama_config, make_llama, prompt
from trainer_ext.errors import ConfigError
from trainer_ext.inference import init_empty_weights, load_checkpoint_and_dispatch


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_empty_weights_are_meta_buffers_real_ties_kept() -> None:
    with init_empty_weights():
        model = LlamaForCausalLM(llama_config())
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"cpu"}  # rotary frequencies are computed, not saved
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone afterwards


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("given", ["class", "auto class", "config", "empty instance"])
def test_loaded_model_matches_the_saved_one(checkpoints, layout, given) -> None:
    path = checkpoints[layout]
    if layout == "sharded":
        assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 5
    if given == "empty instance":
        with init_empty_weights():
            model = LlamaForCausalLM(llama_config())
        assert all(p.device.type == "meta" for p in model.parameters())
    else:
        classes = {"class": LlamaForCausalLM, "auto class": AutoModelForCausalLM}
        model = classes[given] if given in classes else LlamaForCausalLM.config_class.from_pretrained(path)
    loaded = load_checkpoint_and_dispatch(model, path, max_memory={"cpu": "200KB"}, print_summary=False)
    assert loaded.hf_device_map["model.layers"] == "disk" and loaded.hf_device_map["lm_head"] == "cpu"
    # disk weights were never read into memory: they are still meta placeholders
    assert loaded.model.layers[1].mlp.down_proj.weight.device.type == "meta"
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    reference, ids = checkpoints["model"], prompt()
    assert torch.equal(_logits(loaded, ids), _logits(reference, ids))
    kwargs = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(loaded.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def test_all_in_ram_and_copied_to_offload_dir(checkpoints, tmp_path) -> None:
    reference, ids = checkpoints["model"], prompt()
    in_ram = load_checkpoint_and_dispatch(LlamaForCausalLM, checkpoints["sharded"], {"": "cpu"}, print_summary=False)
    assert all(p.device.type == "cpu" for p in in_ram.parameters())
    assert torch.equal(_logits(in_ram, ids), _logits(reference, ids))
    copied = load_checkpoint_and_dispatch(
        LlamaForCausalLM, checkpoints["single"], {"": "disk"}, offload_dir=tmp_path, print_summary=False
    )
    assert (tmp_path / "model.safetensors").is_file()
    assert torch.equal(_logits(copied, ids), _logits(reference, ids))


def test_dtype_on_load(checkpoints) -> None:
    reference, ids = checkpoints["model"], prompt()
    model = load_checkpoint_and_dispatch(
        LlamaForCausalLM, checkpoints["single"], max_memory={"cpu": "190KB"}, dtype=torch.bfloat16, print_summary=False
    )
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # computed buffers keep their dtype
    # sized as bf16, two layers fit in RAM (as float32 not even one would)
    assert model.hf_device_map["model.layers.0"] == model.hf_device_map["model.layers.1"] == "cpu"
    assert model.hf_device_map["model.layers.2"] == "disk"
    expected = _logits(copy_to_bf16(reference), ids)
    assert torch.equal(_logits(model, ids), expected)


def copy_to_bf16(model):
    """A copy with bf16 parameters; buffers (rotary frequencies) stay float32, as the loader leaves them."""
    import copy

    model = copy.deepcopy(model)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model


def _peak_rss_growth(fn) -> int:
    """Bytes the peak resident set grew by while ``fn`` ran (Linux: reset with /proc/self/clear_refs)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("cannot reset the peak RSS here")

    def read(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    before = read("VmRSS:")
    result = fn()
    growth = read("VmHWM:") - before
    del result
    return growth


def test_loading_never_holds_the_full_model(tmp_path) -> None:
    """A 74 MiB model, a quarter of it in RAM, the rest left in its checkpoint: the peak RSS stays far below it.

    (Loading it all into RAM instead grows the peak by about twice its size: the mapped file plus the copy.)
    """
    big = make_llama(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, vocab_size=1024)
    size = sum(p.numel() * p.element_size() for p in big.parameters())
    big.save_pretrained(tmp_path, max_shard_size="4MB")
    del big
    budget = size // 4

    def load():
        return load_checkpoint_and_dispatch(
            LlamaForCausalLM, tmp_path, max_memory={"cpu": budget}, print_summary=False
        )

    growth = _peak_rss_growth(load)
    assert growth < 0.6 * size, f"peak RSS grew by {growth / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB model"


def test_missing_weights_are_named(checkpoints) -> None:
    with init_empty_weights():
        six_layers = LlamaForCausalLM(llama_config(layers=6))
    with pytest.raises(ConfigError, match=r"has no values for \d+ tensors of LlamaForCausalLM.*model.layers.4"):
        load_checkpoint_and_dispatch(six_layers, checkpoints["single"], {"": "cpu"})


@pytest.mark.parametrize(
    ("bad", "message"),
    [("nowhere", "does not exist"), ("config.json", "has no 'weight_map'"), ("weights.bin", "only safetensors")],
)
def test_bad_checkpoint_paths(checkpoints, tmp_path, bad, message) -> None:
    (tmp_path / "weights.bin").write_bytes(b"not safetensors")
    path = checkpoints["single"] / bad if bad == "config.json" else tmp_path / bad
    with pytest.raises(ConfigError, match=message):
        load_checkpoint_and_dispatch(LlamaForCausalLM, path, {"": "cpu"})


def test_folder_without_weights(tmp_path) -> None:
    with pytest.raises(ConfigError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        load_checkpoint_and_dispatch(make_llama(), tmp_path, {"": "cpu"})


def test_shape_mismatch_is_named(checkpoints) -> None:
    with init_empty_weights():
        wider = LlamaForCausalLM(llama_config(intermediate_size=256))
    with pytest.raises(ConfigError, match=r"gate_proj.weight has shape \(128, 64\) in the checkpoint but \(256, 64\)"):
        load_checkpoint_and_dispatch(wider, checkpoints["single"], {"": "cpu"})


def test_generation_config_comes_from_the_folder(tmp_path) -> None:
    model = make_llama()
    model.generation_config.max_new_tokens = 3
    model.save_pretrained(tmp_path)
    loaded = load_checkpoint_and_dispatch(LlamaForCausalLM, tmp_path, {"": "cpu"}, print_summary=False)
    assert loaded.generation_config.max_new_tokens == 3
    assert loaded.generate(prompt(length=4)).shape == (2, 7)


def test_model_argument_forms(checkpoints) -> None:
    with pytest.raises(ConfigError, match="model must be a module, a model class or a config, not str"):
        load_checkpoint_and_dispatch("llama", checkpoints["single"], {"": "cpu"})
