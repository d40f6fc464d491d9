"""One GPU plus CPU offload: same outputs as the model held whole on the GPU, at a fraction of the memory."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.inference.dispatch_models import make_llama, prompt
from trainer_ext.inference import dispatch_model, load_checkpoint_and_dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model() -> tuple[LlamaForCausalLM, int]:
    model = make_llama(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, vocab_size=1024)
    return model, sum(p.numel() * p.element_size() for p in model.parameters())


def _reference(model: LlamaForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and greedy tokens of the whole model on the GPU, computed before anything is dispatched."""
    whole = copy.deepcopy(model).to("cuda")
    with torch.no_grad():
        logits = whole(ids.cuda()).logits.cpu()
    tokens = whole.generate(ids.cuda(), max_new_tokens=8, do_sample=False).cpu()
    del whole
    torch.cuda.empty_cache()
    return logits, tokens


def _peak_during(fn) -> tuple[object, int]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - base


def test_one_gpu_with_cpu_offload() -> None:
    model, size = _model()
    ids = prompt()
    logits, tokens = _reference(model, ids)

    def run():
        dispatch_model(model, max_memory={0: size // 3, "cpu": "2GB"})
        with torch.no_grad():
            out = model(ids).logits
        return out, model.generate(ids, max_new_tokens=8, do_sample=False)

    (out, generated), peak = _peak_during(run)
    print(f"\npeak GPU memory {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB model (1 GPU + CPU offload)")
    assert 0 in model.hf_device_map.values() and "cpu" in model.hf_device_map.values()
    assert out.device.type == "cpu"  # outputs come back where the inputs were
    torch.testing.assert_close(out, logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(generated.cpu(), tokens)
    assert peak < 0.6 * size


def test_load_straight_to_the_gpu(tmp_path) -> None:
    model, size = _model()
    ids = prompt()
    logits, _ = _reference(model, ids)
    model.save_pretrained(tmp_path, max_shard_size="8MB")
    del model

    def run():
        loaded = load_checkpoint_and_dispatch(LlamaForCausalLM, tmp_path, max_memory={0: size // 2, "cpu": "2GB"})
        with torch.no_grad():
            return loaded(ids.cuda()).logits

    out, peak = _peak_during(run)
    print(f"\npeak GPU memory {peak / 2**20:.1f} MiB loading a {size / 2**20:.1f} MiB model (half on the GPU)")
    torch.testing.assert_close(out.cpu(), logits, rtol=1e-4, atol=1e-4)
    assert peak < 0.75 * size


def test_cpu_modules_can_run_on_the_cpu() -> None:
    model, size = _model()
    ids = prompt()
    with torch.no_grad():
        expected = copy.deepcopy(model)(ids).logits
    dispatch_model(model, max_memory={0: size // 3, "cpu": "2GB"}, main_device="cpu")
    layer = next(m for name, m in model.named_modules() if model.hf_device_map.get(name) == "cpu")
    assert next(layer.parameters()).device.type == "cpu"
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-3, atol=1e-3)
