"""Step ``dispatch``: ``trainer_ext.dispatch_model(device_map="auto")`` over a GPU budget smaller than the model.

On CUDA: a bf16 Llama of 302 MiB, its logits and greedy tokens whole on the GPU, then dispatched with a third of
it allowed on GPU 0 and the rest in CPU RAM: the same logits and tokens, the map, the GPU peak and the forward time.
Dry run: the "test" model of benchmarks/dispatch.py over a third in CPU RAM and the rest on disk, against itself whole.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from benchmarks.gpu_kit.kit import Context, accelerate_imported, hide_accelerate

# hidden 1024, 12 layers, vocabulary 8,192, untied: 158M parameters, 302 MiB in bf16. bf16 because that is how big
# models are served; the check stays bit-exactness, since every module of the dispatched model runs on the same GPU
# with the same weights and shapes as the whole model (CPU modules are copied there before they run), so the dtype
# does not loosen it. The vocabulary is 8,192 rather than 32,000: "auto" fills GPU 0 in order from the embedding and
# holds the largest module's weights back for the offloaded ones, so with a third of the model as budget a 65 MB
# embedding (a fifth of the model, unlike any real LLM) leaves no room and the whole map goes to the CPU.
GPU_LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=8192, tie_word_embeddings=False)  # fmt: skip
# Outputs of the same kernels on the same inputs are expected equal to the bit. A difference up to this (relative to
# the largest reference logit) is only noted: a kernel picked differently (e.g. for a weight's alignment) moves bf16
# logits by a few ulps (2**-8 relative), never by more; a wrong weight or a lost layer moves them by O(1).
TOLERANCE = {"cuda": 2**-6, "cpu": 1e-6}
NEW_TOKENS = 16


def run(ctx: Context) -> None:
    hide_accelerate()  # as where it is not installed: transformers sees none, an import of it by ours fails
    import torch

    import trainer_ext

    if ctx.cuda:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(max_position_embeddings=256, attn_implementation="sdpa", **GPU_LLAMA)
        torch.manual_seed(0)
        with torch.device("cuda"):  # initialised on the GPU (the CPU takes seconds for 161M parameters)
            model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        ids = torch.randint(3, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    else:
        from benchmarks.dispatch import build

        torch.set_num_threads(1)  # steady timings of a 0.6 MiB model on a shared CPU
        model = build("test")
        ids = torch.randint(3, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    size = sum(t.numel() * t.element_size() for t in {id(p): p for p in model.parameters()}.values())
    ctx.record(model_mb=round(size / 2**20, 1), dtype=str(model.dtype).removeprefix("torch."), prompt=list(ids.shape))

    # the reference: the whole model on one device (the GPU; in the dry run the CPU)
    reference_logits, reference_tokens = _outputs(model, ids)
    repeats = 3 if ctx.cuda else 5  # the CPU is shared with others: more tries for a steady best
    whole_s = _forward_seconds(model, ids, ctx.cuda, repeats)
    ctx.record(whole_forward_ms=round(whole_s * 1e3, 2))

    if ctx.cuda:
        model.to("cpu")  # the realistic start: a model in RAM that does not fit the GPU's budget
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        max_memory: dict[Any, Any] = {0: size // 3, "cpu": 4 * size}
        offload_dir = None
    else:
        base, max_memory = 0, {"cpu": size // 3}
        offload_dir = str(ctx.work / "offload")
        model = copy.deepcopy(model)  # the dispatched one is a copy; the reference stays whole
    ctx.record(max_memory={str(k): int(v) for k, v in max_memory.items()}, offload_dir=offload_dir)

    started = time.perf_counter()
    trainer_ext.dispatch_model(model, device_map="auto", max_memory=max_memory, offload_dir=offload_dir)
    ctx.record(dispatch_s=round(time.perf_counter() - started, 2), summary=trainer_ext.dispatch_summary(model))
    device_map = {name: str(device) for name, device in model.hf_device_map.items()}
    entries = [f"{name or '(root)'}: {device}" for name, device in device_map.items()]
    per_device: dict[str, int] = {}
    for device in device_map.values():
        per_device[device] = per_device.get(device, 0) + 1
    ctx.record(
        modules_per_device=per_device,
        weights_bytes_per_device=_bytes_per_device(model, device_map),
        map_first=entries[:3] if len(entries) > 6 else entries,
        map_last=entries[-3:] if len(entries) > 6 else [],
        map_entries=len(entries),
    )
    places = ("0", "cpu") if ctx.cuda else ("cpu", "disk")
    ctx.check(set(places) <= set(per_device), f"the map does not use both {' and '.join(places)}: {per_device}")

    logits, tokens = _outputs(model, ids)
    diff = (logits.float() - reference_logits.float()).abs().max().item()
    scale = reference_logits.float().abs().max().item()
    same_tokens = torch.equal(tokens, reference_tokens)
    ctx.record(
        logits_max_abs_diff=diff,
        logits_bit_exact=diff == 0.0,
        logits_scale=round(scale, 3),
        greedy_tokens_equal=same_tokens,
        new_tokens=NEW_TOKENS,
    )
    if 0 < diff <= TOLERANCE[ctx.device] * scale:
        ctx.note(f"logits not bit-exact: max abs diff {diff:.3g} (largest logit {scale:.3g}), within the tolerance")
    ctx.check(
        diff <= TOLERANCE[ctx.device] * scale,
        f"dispatched logits differ from the whole model's: max abs diff {diff:.3g} (largest logit {scale:.3g}, "
        f"tolerance {TOLERANCE[ctx.device] * scale:.3g})",
    )
    if not same_tokens:
        new, ref = tokens[:, ids.shape[1] :], reference_tokens[:, ids.shape[1] :]
        ctx.problem(
            f"greedy tokens differ at {int((new != ref).sum())} of {ref.numel()} generated positions: "
            f"{new.tolist()} vs {ref.tolist()}"
        )

    dispatched_s = _forward_seconds(model, ids, ctx.cuda, repeats)
    ctx.record(dispatched_forward_ms=round(dispatched_s * 1e3, 2), forward_slowdown=round(dispatched_s / whole_s, 2))
    if ctx.cuda:
        peak = torch.cuda.max_memory_allocated() - base
        ctx.record(gpu_peak_mb=round(peak / 2**20, 1), gpu_peak_of_model=round(peak / size, 3))
        budget = max_memory[0]
        # the budget counts weights only (activations are not budgeted, docs/dispatch.md): allow 64 MiB over it
        ctx.check(
            peak <= budget + 64 * 2**20,
            f"GPU peak {peak / 2**20:.0f} MiB during the dispatched run is over the budget {budget / 2**20:.0f} MiB "
            f"(+64 MiB for activations) for a {size / 2**20:.0f} MiB model",
        )
    ctx.record(accelerate_imported=accelerate_imported())
    ctx.check(not accelerate_imported(), "trainer_ext's dispatch tried to import accelerate")


def _outputs(model: Any, ids: Any) -> tuple[Any, Any]:
    """Logits of one forward and ``NEW_TOKENS`` greedy tokens, both on the CPU."""
    import torch

    with torch.no_grad():
        logits = model(ids).logits.cpu()
    tokens = model.generate(
        ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    ).cpu()
    return logits, tokens


def _forward_seconds(model: Any, ids: Any, cuda: bool, repeats: int) -> float:
    """The best of ``repeats`` timed forwards after one warm-up."""
    import torch

    best = float("inf")
    with torch.no_grad():
        for i in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            model(ids)
            if cuda:
                torch.cuda.synchronize()
            if i:
                best = min(best, time.perf_counter() - started)
    return best


def _bytes_per_device(model: Any, device_map: dict[str, str]) -> dict[str, int]:
    """The bytes of the model's parameters and buffers per device of ``device_map`` (each tensor under the map's
    longest key that is its module or one above it)."""
    out: dict[str, int] = {}
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, tensor in tensors.items():
        keys = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
        if keys:
            device = device_map[max(keys, key=len)]
            out[device] = out.get(device, 0) + tensor.numel() * tensor.element_size()
    return out


def _mib(n: Any) -> str:
    return f"{n / 2**20:.3g} MiB" if isinstance(n, (int, float)) else str(n)


def summarize(f: dict[str, Any]) -> list[str]:
    budget = {device: _mib(n) for device, n in f.get("max_memory", {}).items()}
    weights = {device: _mib(n) for device, n in f.get("weights_bytes_per_device", {}).items()}
    shown = ", ".join(f.get("map_first", [])) + (" ... " + ", ".join(f["map_last"]) if f.get("map_last") else "")
    lines = [
        f"{f.get('model_mb')} MiB {f.get('dtype')} Llama, max_memory {budget}: modules per device "
        f"{f.get('modules_per_device')}, weights per device {weights}",
        f"map ({f.get('map_entries')} entries): {shown}",
        f"logits max abs diff {f.get('logits_max_abs_diff')} (bit-exact: {f.get('logits_bit_exact')}), greedy "
        f"tokens ({f.get('new_tokens')}) equal: {f.get('greedy_tokens_equal')}",
        f"forward whole {f.get('whole_forward_ms')} ms, dispatched {f.get('dispatched_forward_ms')} ms "
        f"(x{f.get('forward_slowdown')}); dispatch took {f.get('dispatch_s')} s",
    ]
    if "gpu_peak_mb" in f:
        lines.append(
            f"GPU peak during the dispatched run {f['gpu_peak_mb']} MiB = {f['gpu_peak_of_model']} of the model"
        )
    return lines
