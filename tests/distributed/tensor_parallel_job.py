"""Rank job: a tiny model of each named architecture, sharded over a tp mesh of all ranks by its own plan, against
the same model and batch in this process alone; writes the largest differences to OUT/rank<R>.json.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.distributed.tensor_parallel_job OUT float64 3 llama

DTYPE and STEPS, then the architectures (one may end in ``+tied``: tied word embeddings). Per step: the loss, every
parameter's gradient (``full_tensor()``), the total norm clipped by ``clip_grad_norm`` (max norm 0.5, so it clips),
then AdamW; at the end the weights.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.distributed.mesh.device_mesh import build_parallel_mesh
from trainer_ext.distributed.mesh.grad_norm import clip_grad_norm, total_grad_norm
from trainer_ext.distributed.mesh.tensor_parallel import apply_tensor_parallel
from trainer_ext.errors import ConfigError

MAX_NORM = 0.5


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, **sizes: int) -> torch.nn.Module:
    """A 2-layer model of ``arch`` (hidden 64, 4 heads, 2 KV heads unless ``sizes`` say) from its config, seeded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    name, _, tied = arch.partition("+")
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    config = AutoConfig.for_model(
        name,
        **{**shape, **sizes},
        num_hidden_layers=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied == "tied",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((_full(a[k]) - b[k]).abs().max().item() for k in a)


def compare(arch: str, mesh, dtype: torch.dtype, steps: int) -> dict:
    reference = tiny_model(arch, dtype)
    sharded = apply_tensor_parallel(copy.deepcopy(reference), mesh)
    n_dtensors = sum(isinstance(p, DTensor) for p in sharded.parameters())
    tied = sharded.get_output_embeddings().weight is sharded.get_input_embeddings().weight
    torch.manual_seed(1)
    batch = torch.randint(0, 128, (2, 12))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tp_opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    seen: dict = {"dtensors": n_dtensors, "tied": tied, "loss": 0.0, "grad": 0.0, "norm": 0.0, "clipped": 0.0}
    for _ in range(steps):
        ref_loss = reference(input_ids=batch, labels=batch).loss
        tp_loss = sharded(input_ids=batch, labels=batch).loss
        ref_loss.backward()
        tp_loss.backward()
        seen["loss"] = max(seen["loss"], abs(_full(tp_loss).item() - ref_loss.item()))
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        tp_grads = {n: p.grad for n, p in sharded.named_parameters()}
        seen["grad"] = max(seen["grad"], _max_diff(tp_grads, ref_grads))
        ref_inf = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], float("inf"))
        seen["inf_norm"] = abs(total_grad_norm(sharded.parameters(), float("inf")).item() - ref_inf.item())
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        tp_norm = clip_grad_norm(sharded.parameters(), MAX_NORM)
        seen["norm"] = max(seen["norm"], abs(tp_norm.item() - ref_norm.item()))
        seen["ref_norm"] = ref_norm.item()
        clipped = {n: p.grad for n, p in sharded.named_parameters()}
        seen["clipped"] = max(
            seen["clipped"], _max_diff(clipped, {n: p.grad for n, p in reference.named_parameters()})
        )
        ref_opt.step()
        tp_opt.step()
        ref_opt.zero_grad()
        tp_opt.zero_grad()
    seen["weights"] = _max_diff(dict(sharded.named_parameters()), dict(reference.named_parameters()))
    seen["stock_clip"] = _stock_clip(sharded, batch)
    seen["all_dtensors"] = all(isinstance(p, DTensor) for p in sharded.parameters())
    seen["taken_as_is"] = apply_tensor_parallel(sharded, mesh) is sharded and n_dtensors == sum(
        isinstance(p, DTensor) for p in sharded.parameters()
    )
    return seen


def refusals(mesh) -> dict[str, str]:
    """The one-line errors of plans or sizes that cannot be applied, on a real mesh; no parameter is touched."""
    cases = {
        "heads": (dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3), None),
        "kv_heads": (dict(num_key_value_heads=1), None),
        "intermediate": (dict(intermediate_size=127), None),
        "vocab": (dict(vocab_size=127), None),
        "style": ({}, {"model.layers.*.mlp.down_proj": "local_rowwise"}),
        "typo": ({}, {"model.layers.*.mlp.dwn_proj": "rowwise"}),
    }
    seen = {}
    for case, (sizes, plan) in cases.items():
        model = tiny_model("llama", **sizes)
        try:
            apply_tensor_parallel(model, mesh, plan)
            seen[case] = "applied"
        except ConfigError as exc:
            untouched = not any(isinstance(p, DTensor) for p in model.parameters())
            seen[case] = str(exc) if untouched else f"sharded before refusing: {exc}"
    return seen


def _stock_clip(model: torch.nn.Module, batch: torch.Tensor) -> str:
    """What torch's own ``clip_grad_norm_`` does with the sharded model (every parameter a DTensor, so it works)."""
    model(input_ids=batch, labels=batch).loss.backward()
    try:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    except Exception as exc:  # noqa: BLE001 - recorded for the report, not handled
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return f"ok {float(_full(norm)):.6g}"


def main(out: str, dtype: str, steps: str, *archs: str) -> None:
    dist.init_process_group("gloo")
    mesh = build_parallel_mesh(ParallelismConfig(tp_size=dist.get_world_size()), "cpu")["tp"]
    seen = {arch: compare(arch, mesh, getattr(torch, dtype), int(steps)) for arch in archs if arch != "refusals"}
    if "refusals" in archs:
        seen["refusals"] = refusals(mesh)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
