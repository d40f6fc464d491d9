"""Slowdown of big-model offload: the same model run whole, and dispatched over CPU RAM and disk.

    python benchmarks/dispatch.py [--size test|small] [--repeats 20] [--json out.json]

``test`` is the model of tests/inference (4 Llama layers of width 64, 0.6 MiB); ``small`` has 8 layers of
width 512 (74 MiB). Each layout runs a forward on a (2, 32) batch and a greedy generation of 16 tokens;
the time is the best of ``repeats`` round-robin runs after one warm-up, and the ratio is against the
model run whole (undispatched). Layouts: ``dispatched, all in RAM`` (hooks only) and ``CPU + disk`` (a
third of the weights in RAM, the rest memory-mapped from ``offload_dir`` and loaded per module), timed
with the offload files in the OS page cache (warm: repeated inference with RAM to spare) and, on Linux,
also with them evicted before each timed call (cold: every call reads them from disk).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import json
import mmap
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer_ext.inference import dispatch_model
from trainer_ext.inference.hooks import HOOK_ATTR

SIZES = {
    "test": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4),
    "small": dict(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8
    ),
}


def build(size: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    spec = SIZES[size]
    config = LlamaConfig(
        num_key_value_heads=spec["num_attention_heads"] // 2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **spec,
    )
    return LlamaForCausalLM(config).eval()


def timed(fn: Callable[[], Any], before: Callable[[], None] | None = None) -> float:
    """Seconds one call of ``fn`` takes; ``before`` runs first, untimed."""
    if before is not None:
        before()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def page_cache_evicter(model: torch.nn.Module, offload_dir: str) -> Callable[[], None] | None:
    """A function that drops the offloaded weights from memory (our mapping and the OS page cache), Linux only.

    Only the offload files are touched (madvise on our own views, fadvise on our own files), so a cold
    run reads them from disk again without disturbing anything else on the machine.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fadvise = os.posix_fadvise
    except (OSError, AttributeError):
        return None
    views = [
        fetch.source._view
        for module in model.modules()
        for fetch in getattr(getattr(module, HOOK_ATTR, None), "fetches", [])
        if getattr(fetch.source, "_view", None) is not None
    ]
    page, madv_dontneed = mmap.PAGESIZE, 4

    def evict() -> None:
        for view in views:
            start = view.data_ptr() & ~(page - 1)
            libc.madvise(start, view.data_ptr() + view.nbytes - start, madv_dontneed)
        for name in os.listdir(offload_dir):
            fd = os.open(os.path.join(offload_dir, name), os.O_RDONLY)
            try:
                fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    return evict


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="test")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steady timings for small models on a shared machine)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)

    whole = build(opts.size)
    size = sum(p.numel() * p.element_size() for p in whole.parameters())
    ids = torch.randint(3, whole.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    offload_dir = tempfile.mkdtemp(prefix="dispatch-bench-")
    layouts = {
        "undispatched": whole,
        "dispatched, all in RAM": dispatch_model(copy.deepcopy(whole), {"": "cpu"}, print_summary=False),
        "CPU + disk": dispatch_model(
            copy.deepcopy(whole), max_memory={"cpu": size // 3}, offload_dir=offload_dir, print_summary=False
        ),
    }
    print(
        f"size={opts.size} ({size / 2**20:.2f} MiB fp32) batch=(2, 32) new_tokens={opts.new_tokens} "
        f"repeats={opts.repeats} threads={torch.get_num_threads()} torch={torch.__version__}"
    )
    print("CPU + disk layout:", layouts["CPU + disk"].hf_device_map)

    def forward(model: LlamaForCausalLM) -> None:
        with torch.no_grad():
            model(ids)

    def generate(model: LlamaForCausalLM) -> None:
        model.generate(ids, max_new_tokens=opts.new_tokens, min_new_tokens=opts.new_tokens, do_sample=False)

    reference = layouts["undispatched"].generate(ids, max_new_tokens=opts.new_tokens, do_sample=False)
    for name, model in layouts.items():
        same = torch.equal(model.generate(ids, max_new_tokens=opts.new_tokens, do_sample=False), reference)
        assert same, f"{name}: greedy tokens differ from the undispatched model"
    runs = {name: (model, None) for name, model in layouts.items()}
    evict = page_cache_evicter(layouts["CPU + disk"], offload_dir)
    if evict is not None:
        evict()
        runs["CPU + disk, cold cache"] = (layouts["CPU + disk"], evict)
    results: dict[str, dict[str, float]] = {name: {} for name in runs}
    for model, _ in runs.values():  # warm-up
        forward(model)
        generate(model)
    for _ in range(opts.repeats):  # round-robin over the layouts, best of N: noise hits them all alike
        for name, (model, before) in runs.items():
            for task, fn in (("forward_s", forward), ("generate_s", generate)):
                t = timed(lambda model=model, fn=fn: fn(model), before)
                results[name][task] = min(t, results[name].get(task, float("inf")))
    base = results["undispatched"]
    print(f"{'layout':26} {'forward ms':>11} {'ratio':>7} {'generate ms':>12} {'ratio':>7}")
    for name, r in results.items():
        r["forward_ratio"] = r["forward_s"] / base["forward_s"]
        r["generate_ratio"] = r["generate_s"] / base["generate_s"]
        print(
            f"{name:26} {r['forward_s'] * 1e3:11.2f} {r['forward_ratio']:7.2f} "
            f"{r['generate_s'] * 1e3:12.1f} {r['generate_ratio']:7.2f}"
        )
    report = {"size": opts.size, "model_bytes": size, "new_tokens": opts.new_tokens, "results": results}
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
