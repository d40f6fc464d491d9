"""Step ``context_parallel``: torch's ring attention (``cp_backend="torch"``) and ours (``all_gather``) against plain
SDPA through transformers, on one device in one process: a 1-rank process group (nccl on CUDA, gloo in the dry run)
and a 1-D mesh ``cp`` of size 1.

A tiny grouped-query Llama (bf16 on CUDA, float32 in the dry run) adopts the context-parallel attention
(``cp_attention.adopt``) and runs forward and backward inside ``context_parallel(mesh["cp"], ...)`` with the batch
made by ``cp_batch.prepare_batch`` (``shift_labels`` built before the split, global ``position_ids``); its logits
(put back in order with ``SequenceSplit.unshard``), loss and every parameter gradient are compared with the same
model outside any region. One rank cannot exchange anything over the ring: that needs 2+ GPUs (docs/gpu.md).
torch's backend has no CPU kernel, so the dry run checks ``all_gather`` and that ``torch`` is refused off CUDA.
"""

from __future__ import annotations

import copy
import time
import traceback
from typing import Any

from benchmarks.gpu_kit.kit import Context, accelerate_imported, hide_accelerate

# LlamaConfig fields per device: grouped-query heads (4 query heads share each key/value head on CUDA)
LLAMA = {
    "cuda": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False),
    "cpu": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False),
}  # fmt: skip
SHAPE = {"cuda": (2, 256), "cpu": (2, 32)}  # rows x positions; positions a multiple of 2 x cp = 2
PROMPT = 3  # the first positions of each row are labelled -100 (a prompt the loss ignores)
# the largest difference allowed, relative to the reference's largest value (logits; each parameter's gradient;
# the loss): bf16 kernels picked differently (flash with is_causal vs an explicit mask) differ by a few ulps of
# 2**-8; float32 SDPA with and without an explicit mask by ~1e-7
TOLERANCE = {"cuda": 2e-2, "cpu": 1e-5}


def run(ctx: Context) -> None:
    hide_accelerate()  # as where it is not installed: transformers sees none, an import of it by ours fails
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer_ext.distributed.mesh.context_parallel import resolve_backend
    from trainer_ext.errors import ConfigError

    group_backend = "nccl" if ctx.cuda else "gloo"
    extra = {"device_id": torch.device("cuda", 0)} if ctx.cuda else {}
    if ctx.cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(group_backend, store=dist.HashStore(), rank=0, world_size=1, **extra)
    try:
        mesh = init_device_mesh(ctx.device, (1,), mesh_dim_names=("cp",))
        ctx.record(process_group=group_backend, mesh=f"{list(mesh.mesh_dim_names)} {list(mesh.shape)}")
        ctx.record(auto_backend=resolve_backend("auto", ctx.device), tolerance=TOLERANCE[ctx.device])
        backends = ["all_gather", "torch"]
        if not ctx.cuda:
            try:
                resolve_backend("torch", ctx.device)
                ctx.problem(
                    "cp_backend='torch' was not refused on the CPU (torch's context_parallel has no CPU kernel)"
                )
            except ConfigError as exc:
                ctx.record(torch_refused_on_cpu=str(exc))
            ctx.note("cp_backend='torch' not run: torch's context_parallel has no CPU kernel (the GPU run checks it)")
            backends.remove("torch")
        compare(ctx, mesh, backends)
    finally:
        dist.destroy_process_group()
    ctx.check(not accelerate_imported(), "the context-parallel run tried to import accelerate")


def tiny_llama(device: str) -> Any:
    """The step's Llama on ``device`` (bf16 on CUDA, float32 on the CPU), SDPA attention, seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=SHAPE[device][1], attn_implementation="sdpa", **LLAMA[device])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16 if device == "cuda" else torch.float32).train()


def batch(device: str, vocab: int) -> dict[str, Any]:
    """Random tokens; their labels, the first :data:`PROMPT` positions of each row ignored."""
    import torch

    rows, length = SHAPE[device]
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def compare(ctx: Context, mesh: Any, backends: list[str], reference: Any = None, candidate: Any = None) -> None:
    """Each backend's logits, loss and gradients of ``candidate`` (a copy of ``reference``, the step's Llama when
    None) in a region against ``reference`` outside any; the figures per backend, a problem beyond the tolerance."""
    import torch

    from trainer_ext.distributed.mesh import cp_attention
    from trainer_ext.distributed.mesh.context_parallel import SequenceSplit

    reference = tiny_llama(ctx.device) if reference is None else reference
    inputs = batch(ctx.device, reference.config.vocab_size)
    out = reference(**inputs, use_cache=False)
    out.loss.backward()
    expected = _result(reference, out)
    ctx.record(
        model=f"Llama {sum(p.numel() for p in reference.parameters()) / 1e6:.2f}M, {reference.config.num_hidden_layers}"
        f" layers, {reference.config.num_attention_heads} heads / {reference.config.num_key_value_heads} key-value heads",
        dtype=str(reference.dtype).removeprefix("torch."),
        shape=list(inputs["input_ids"].shape),
        reference_loss=round(expected["loss"], 6),
    )
    cp = mesh["cp"]
    split = SequenceSplit(cp.size())
    length = inputs["input_ids"].shape[1]
    positions = torch.arange(length, device=inputs["input_ids"].device)
    ctx.record(
        split_reorders_nothing=torch.equal(split.indices(cp.get_local_rank(), length, positions.device), positions)
    )
    ctx.check(ctx.figures["split_reorders_nothing"], f"a split over {cp.size()} rank(s) reorders the positions")
    results = {}
    for backend in backends:
        model = copy.deepcopy(reference if candidate is None else candidate)
        model.zero_grad(set_to_none=True)
        cp_attention.adopt(model)
        try:
            results[backend] = _run_backend(ctx, model, cp, split, inputs, backend)
        except Exception as exc:  # recorded; the other backend still runs
            traceback.print_exc()
            ctx.problem(f"cp_backend={backend!r} failed: {type(exc).__name__}: {str(exc)[-1500:]}")
            continue
        figures = _differences(results[backend], expected)
        ctx.record(**{backend: {**ctx.figures.get(backend, {}), **figures}})
        _check(ctx, backend, figures, TOLERANCE[ctx.device])
    if len(results) == 2:
        ctx.record(torch_vs_all_gather=_differences(results["torch"], results["all_gather"]))


def _run_backend(ctx: Context, model: Any, cp: Any, split: Any, inputs: dict[str, Any], backend: str) -> dict:
    """One forward and backward of ``model`` in a context-parallel region of ``backend``: its logits in sequence
    order, loss and gradients; what the region did in ``ctx.figures[backend]``."""
    import torch
    import torch.nn.functional as F

    from trainer_ext.distributed.mesh import cp_attention
    from trainer_ext.distributed.mesh.context_parallel import context_parallel
    from trainer_ext.distributed.mesh.cp_batch import IGNORE_INDEX, prepare_batch

    prepared, buffers = prepare_batch(inputs, split, backend)
    names = [key for key, value in prepared.items() if any(value is b for b in buffers)]
    shifted = F.pad(inputs["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
    seen: dict[str, Any] = {
        "buffers": names,
        "shift_labels_before_split": torch.equal(prepared["shift_labels"], shifted),
    }
    sdpa = F.scaled_dot_product_attention
    if ctx.cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    with context_parallel(
        cp, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers), backend=backend
    ):
        seen["sdpa_replaced_in_region"] = F.scaled_dot_product_attention is not sdpa  # torch's ring: monkey-patched
        out = model(**prepared, use_cache=False)
        out.loss.backward()
    if ctx.cuda:
        torch.cuda.synchronize()
    seen["seconds"] = round(time.perf_counter() - started, 3)
    layers = [m for m in model.modules() if cp_attention._RAN_IN_REGION in m.__dict__]
    seen["layers_in_region"] = f"{sum(m.__dict__[cp_attention._RAN_IN_REGION] for m in layers)} of {len(layers)}"
    ctx.record(**{backend: seen})
    ctx.check(seen["shift_labels_before_split"], f"{backend}: prepare_batch's shift_labels are not the labels shifted")
    ctx.check(
        bool(layers) and all(m.__dict__[cp_attention._RAN_IN_REGION] for m in layers)
        and len(layers) == model.config.num_hidden_layers,
        f"{backend}: the context-parallel attention ran in the region in {seen['layers_in_region']} layers "
        f"({model.config.num_hidden_layers} expected)",
    )  # fmt: skip
    if backend == "torch":
        ctx.check(seen["sdpa_replaced_in_region"], "torch: context_parallel did not replace SDPA with ring attention")
    result = _result(model, out)
    result["logits"] = split.unshard([result["logits"]], 1)  # one rank: the order it had (checked above)
    return result


def _result(model: Any, out: Any) -> dict[str, Any]:
    """Logits and every parameter's gradient (float32 copies), and the loss, of one forward and backward."""
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": out.logits.detach().float(), "loss": out.loss.item(), "grads": grads}


def _differences(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """The largest differences of logits, loss and gradients (absolute, and relative to ``want``'s largest value;
    gradients per parameter, the worst named)."""
    logits = (got["logits"] - want["logits"]).abs().max().item()
    scale = want["logits"].abs().max().item()
    figures = {
        "logits_max_abs_diff": logits,
        "logits_rel_diff": logits / max(scale, 1e-30),
        "loss": round(got["loss"], 6),
        "loss_rel_diff": abs(got["loss"] - want["loss"]) / max(abs(want["loss"]), 1e-30),
        "grads_compared": f"{len(got['grads'].keys() & want['grads'].keys())} of {len(want['grads'])}",
    }
    worst, grads_abs, grads_rel = None, 0.0, 0.0
    for name, grad in want["grads"].items():
        if name not in got["grads"]:
            continue
        diff = (got["grads"][name] - grad).abs().max().item()
        rel = diff / max(grad.abs().max().item(), 1e-30)
        grads_abs = max(grads_abs, diff)
        if rel > grads_rel:
            worst, grads_rel = name, rel
    figures.update(grads_max_abs_diff=grads_abs, grads_rel_diff=grads_rel, grads_worst=worst)
    return figures


def _check(ctx: Context, backend: str, f: dict[str, Any], tolerance: float) -> None:
    """A problem for each comparison with plain SDPA beyond ``tolerance``, or gradients missing."""
    ctx.check(
        f["logits_rel_diff"] <= tolerance,
        f"{backend}: logits differ from plain SDPA by {f['logits_max_abs_diff']:.3g} ({f['logits_rel_diff']:.3g} of "
        f"the largest, tolerance {tolerance:g})",
    )
    ctx.check(
        f["loss_rel_diff"] <= tolerance,
        f"{backend}: loss {f['loss']} differs from plain SDPA's by {f['loss_rel_diff']:.3g} (relative, tolerance "
        f"{tolerance:g})",
    )
    ctx.check(
        f["grads_rel_diff"] <= tolerance,
        f"{backend}: gradients differ from plain SDPA's by {f['grads_rel_diff']:.3g} of the largest in "
        f"{f['grads_worst']} (tolerance {tolerance:g})",
    )
    count, total = f["grads_compared"].split(" of ")
    ctx.check(count == total, f"{backend}: gradients of {f['grads_compared']} parameters to compare")


def summarize(f: dict[str, Any]) -> list[str]:
    lines = [
        f"{f.get('model')}, {f.get('dtype')}, batch {f.get('shape')}; a {f.get('process_group')} group of 1 rank, "
        f"mesh {f.get('mesh')}; auto picks {f.get('auto_backend')!r} here",
        f"one rank's split reorders nothing: {f.get('split_reorders_nothing')}; reference (plain SDPA) loss "
        f"{f.get('reference_loss')}; tolerance {f.get('tolerance')} of the largest value",
    ]
    for backend in ("all_gather", "torch"):
        b = f.get(backend)
        if not b:
            continue
        line = (
            f"{backend}: buffers {b.get('buffers')}, shift_labels built before the split: "
            f"{b.get('shift_labels_before_split')}; attention in the region in {b.get('layers_in_region')} layers"
        )
        if backend == "torch":
            line += f"; SDPA replaced by ring attention: {b.get('sdpa_replaced_in_region')}"
        lines.append(line + f"; forward+backward {b.get('seconds')} s")
        if "logits_rel_diff" in b:
            lines.append(
                f"{backend} vs plain SDPA: logits {b['logits_max_abs_diff']:.3g} ({b['logits_rel_diff']:.3g} "
                f"relative), loss {b['loss_rel_diff']:.3g}, gradients {b['grads_max_abs_diff']:.3g} "
                f"({b['grads_rel_diff']:.3g} relative, worst {b['grads_worst'] or '-'}; {b['grads_compared']})"
            )
    both = f.get("torch_vs_all_gather")
    if both:
        lines.append(
            f"torch vs all_gather: logits {both['logits_max_abs_diff']:.3g} ({both['logits_rel_diff']:.3g} relative), "
            f"gradients {both['grads_rel_diff']:.3g} relative (worst {both['grads_worst'] or '-'})"
        )
    if "torch_refused_on_cpu" in f:
        lines.append(f"cp_backend='torch' on the CPU: {f['torch_refused_on_cpu']}")
    return lines
