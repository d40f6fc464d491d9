"""Context parallelism: per-rank activation memory of a training forward + backward, cp=1 against cp=2.

    python -m benchmarks.context_parallel [--config small|tiny] [--lengths 1024,2048,4096] [--cp 2] [--json out.json]

The same Llama (built from a config, float32, SDPA, grouped-query attention) runs one training forward + backward per
sequence length: on one process without context parallelism (cp=1), and on ``cp`` gloo processes with one thread each
through the real loop path: ``Accelerator(parallelism_config=ParallelismConfig(cp_size=cp))``, ``prepare``,
``context_parallel_batch`` and ``accelerator.maybe_context_parallel`` (FSDP2 shards the model over the ``cp`` ranks;
the backend is ``auto``, which is ours, ``all_gather``, on the CPU). Per length and rank (the largest rank reported):

- ``saved MB``: the bytes of the tensors autograd saves for backward during the forward (``saved_tensors_hooks``, each
  storage counted once, parameters left out): the activations proper. Split into ``attn`` (saved inside the attention
  function: queries, keys and values as the kernel gets them, outputs, the log-sum-exp and, under cp, the mask over the
  gathered keys) and the rest of the model (norms, projections, MLP, logits and loss).
- ``mask MB``: of ``attn``, the masks (shape ``[batch, 1, queries, keys]``: SDPA keeps a float32 copy of a boolean
  mask in each layer).
- ``peak MB``: the peak of live tensor bytes during forward + backward above the step's start (torch.profiler's
  allocation events, ``profile_memory=True``): activations, temporaries and the gradients as they are made (all of
  them at cp=1; FSDP2's layer-by-layer gathered parameters and gradients before their reduce-scatter under cp).
- ``RSS MB``: the resident set's peak during the step above the one before it (sampled every 2 ms; glibc's
  ``MALLOC_MMAP_THRESHOLD_`` fixed so that freed tensors leave the resident set), a cross-check of ``peak``.
- ``s/step``: the step's wall time without the profiler; informational (gloo on loopback, the ranks share the cores).
- ``loss``: the training loss, cp=1's and cp's (summed over the ranks, undoing the gradient average), which must agree.

Under our ``all_gather`` backend every rank's queries (its ``L / cp`` tokens) attend to every key: the keys and values of
each layer are gathered to the full length and kept for backward, with a mask of (local queries × all keys) per row, so
those do not fall with cp; everything per token (the residual stream, projections, MLP, logits) does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.parallelism import MMAP_THRESHOLD, RssSampler  # noqa: E402
from benchmarks.run import child_env, last_json, torchrun_args  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    # 10.23M parameters, head_dim 32, 4 query heads per key/value head; vocabulary 8192 (untied head)
    "small": dict(hidden=256, intermediate=768, layers=8, heads=8, kv_heads=2, vocab=8192, lengths=(1024, 2048, 4096)),
    # a smoke run in seconds (CI)
    "tiny": dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512, lengths=(64, 128)),
}
BATCH = 1  # rows per step: one long sequence, the case context parallelism is for
MB = 2**20


def build_model(cfg: dict[str, Any], length: int) -> Any:
    """The config's Llama (float32, SDPA), seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=length,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def _local(tensor: Any) -> Any:
    """A DTensor's local shard (FSDP2's sharded parameters), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class SavedBytes:
    """Bytes of the tensors autograd saves while active, each storage once, parameters left out; those saved inside
    the attention function (``in_attention``) counted apart, and masks among them."""

    def __init__(self, model: Any) -> None:
        self.model, self.in_attention = model, False
        self.seen: dict[int, tuple[int, str]] = {}

    def pack(self, tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self.seen:
            # FSDP2 swaps each layer's gathered parameters in while it runs: ask the model each time
            params = {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
            if ptr not in params:
                mask = tensor.dim() == 4 and tensor.shape[1] == 1
                kind = ("mask" if mask else "attn") if self.in_attention else "rest"
                self.seen[ptr] = (storage.nbytes(), kind)
        return tensor

    def total(self, *kinds: str) -> int:
        return sum(n for n, kind in self.seen.values() if kind in kinds)


def wrap_attention(model: Any, saved: SavedBytes) -> None:
    """Register, under the model's attention name, the same function bracketed so ``saved`` knows what it saves."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    inner = ALL_ATTENTION_FUNCTIONS[name]

    def attention(*args: Any, **kwargs: Any) -> Any:
        saved.in_attention = True
        try:
            return inner(*args, **kwargs)
        finally:
            saved.in_attention = False

    AttentionInterface.register(name, attention)


def live_peak(prof: Any) -> int:
    """The peak of (allocated − freed) bytes over a profile's allocation events, in time order."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


def _child(opts: argparse.Namespace) -> None:
    """One process of one cp size: every length's measurements as JSON (rank 0 prints every rank's)."""
    import torch
    from torch.autograd.graph import saved_tensors_hooks
    from torch.profiler import ProfilerActivity, profile

    from trainer_ext import Accelerator, ParallelismConfig, context_parallel_batch

    cp = int(opts.child)
    cfg = CONFIGS[opts.config]
    lengths = [int(n) for n in opts.lengths.split(",")] if opts.lengths else list(cfg["lengths"])
    config = ParallelismConfig(cp_size=cp) if cp > 1 else None
    accelerator = Accelerator(cpu=True, parallelism_config=config)
    model = accelerator.prepare(build_model(cfg, max(lengths)))
    model.train()
    saved = SavedBytes(model)
    wrap_attention(accelerator.unwrap_model(model), saved)

    def step(batch: dict[str, Any], count: bool = False) -> float:
        prepared = context_parallel_batch(batch, accelerator)
        buffers = prepared.buffers
        hooks = saved_tensors_hooks(saved.pack, lambda tensor: tensor) if count else contextlib.nullcontext()
        with accelerator.maybe_context_parallel(
            buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
        ):
            with hooks:
                loss = model(**prepared.inputs).loss * prepared.loss_scale
            accelerator.backward(loss)
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    results = []
    generator = torch.Generator().manual_seed(0)
    for length in lengths:
        ids = torch.randint(0, cfg["vocab"], (BATCH, length), generator=generator)
        batch = {"input_ids": ids, "labels": ids.clone()}
        step(batch)  # warm-up: one-off allocations (rotary cache, FSDP2 and gloo buffers) out of the figures
        sampler = RssSampler()
        before = RssSampler.current()
        sampler.start()
        start = time.perf_counter()
        loss = step(batch)
        seconds = time.perf_counter() - start
        rss = sampler.stop() - before
        saved.seen.clear()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(batch, count=True)
        results.append(
            {
                "length": length,
                "saved_attn": saved.total("attn", "mask"),
                "saved_mask": saved.total("mask"),
                "saved_rest": saved.total("rest"),
                "peak": live_peak(prof),
                "rss": rss,
                "step_s": seconds,
                "loss": loss,
            }
        )
    if cp == 1:
        print(json.dumps({"ranks": [results]}), flush=True)
        return
    import torch.distributed as dist

    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, results)
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": ranks, "backend": accelerator.engine.cp_backend}), flush=True)
    dist.barrier()
    from trainer_ext.distributed.state import destroy_process_group

    destroy_process_group()


def _launch(cp: int, opts: argparse.Namespace) -> dict[str, Any]:
    """One cp size in fresh processes: plain Python for cp=1, ``torch.distributed.run`` for more."""
    launcher = torchrun_args(cp) if cp > 1 else []
    cmd = [sys.executable, *launcher, "-m", "benchmarks.context_parallel", "--child", str(cp), "--config", opts.config]
    if opts.lengths:
        cmd += ["--lengths", opts.lengths]
    env = child_env()
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"cp={cp} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return last_json(proc.stdout)


def summarize(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Per length, the largest rank's figures in MB (time: the slowest rank), and the loss over the ranks."""
    ranks = raw["ranks"]
    rows = []
    for i, length in enumerate(r["length"] for r in ranks[0]):
        per = [rank[i] for rank in ranks]
        big = max(per, key=lambda r: r["saved_attn"] + r["saved_rest"])
        rows.append(
            {
                "length": length,
                "saved_mb": (big["saved_attn"] + big["saved_rest"]) / MB,
                "attn_mb": big["saved_attn"] / MB,
                "mask_mb": big["saved_mask"] / MB,
                "rest_mb": big["saved_rest"] / MB,
                "peak_mb": max(r["peak"] for r in per) / MB,
                "rss_mb": max(r["rss"] for r in per) / MB,
                "step_s": max(r["step_s"] for r in per),
                "loss": sum(r["loss"] for r in per) / len(per),  # each rank's loss carries the average's factor
            }
        )
    return rows


COLUMNS = ("saved_mb", "attn_mb", "mask_mb", "rest_mb", "peak_mb", "rss_mb", "step_s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default: the config's)")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel processes to compare with one")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        _child(opts)
        return {}
    if opts.cp < 2:
        parser.error(f"--cp {opts.cp}: give the number of context-parallel processes to compare, at least 2")
    lengths = [int(n) for n in opts.lengths.split(",")] if opts.lengths else CONFIGS[opts.config]["lengths"]
    if any(n % (2 * opts.cp) for n in lengths):
        parser.error(f"--lengths {opts.lengths}: each must be a multiple of 2 × cp = {2 * opts.cp} (no padding here)")
    cfg = CONFIGS[opts.config]
    one = summarize(_launch(1, opts))
    raw = _launch(opts.cp, opts)
    many = summarize(raw)
    print(
        f"config={opts.config} ({cfg['layers']}x{cfg['hidden']}, {cfg['heads']} heads / {cfg['kv_heads']} kv, vocab "
        f"{cfg['vocab']}, float32, batch {BATCH}) cp=1: one process; cp={opts.cp}: {opts.cp} gloo processes, "
        f"backend {raw.get('backend')}, OMP_NUM_THREADS=1; MB per rank (the largest)"
    )
    print(
        f"{'length':>6} {'cp':>3} {'saved MB':>9} {'attn':>7} {'mask':>7} {'rest':>8} {'peak MB':>8} "
        f"{'RSS MB':>7} {'s/step':>7} {'loss':>9}"
    )
    rows, held = [], True
    for a, b in zip(one, many, strict=True):
        ratios = {f"{key}_ratio": b[key] / a[key] if a[key] else float("nan") for key in COLUMNS}
        rows.append({"length": a["length"], "cp1": a, f"cp{opts.cp}": b, **ratios})
        held &= ratios["saved_mb_ratio"] < 1 and ratios["peak_mb_ratio"] < 1
        for cp, r in ((1, a), (opts.cp, b)):
            print(
                f"{r['length']:6d} {cp:3d} {r['saved_mb']:9.1f} {r['attn_mb']:7.1f} {r['mask_mb']:7.1f} "
                f"{r['rest_mb']:8.1f} {r['peak_mb']:8.1f} {r['rss_mb']:7.0f} {r['step_s']:7.2f} {r['loss']:9.5f}"
            )
        print(
            f"{'':6} {'÷':>3} {ratios['saved_mb_ratio']:9.3f} {ratios['attn_mb_ratio']:7.3f} {'':7} "
            f"{ratios['rest_mb_ratio']:8.3f} {ratios['peak_mb_ratio']:8.3f} {ratios['rss_mb_ratio']:7.3f} "
            f"{ratios['step_s_ratio']:7.2f} {abs(a['loss'] - b['loss']):9.1e}"
        )
    verdict = "held at every length" if held else "did NOT hold at every length"
    print(f"expectation: saved and peak activation memory per rank fall with cp={opts.cp}: {verdict}")
    report = {
        "config": opts.config,
        "model": cfg,
        "batch": BATCH,
        "cp": opts.cp,
        "backend": raw.get("backend"),
        "held": held,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "rows": rows,
    }
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
