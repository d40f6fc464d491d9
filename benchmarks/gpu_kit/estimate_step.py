"""Step ``estimate``: ``trainer-ext estimate --measure`` on the device, estimated vs measured per term.

On CUDA, one process each: the shipped tiny-llama causal-LM job in bf16 (activations dominate: the known bf16 limit),
and a 12-layer, hidden-768 Llama in bf16 at micro-batch 8 x 256 (weights, gradients and Adam states dominate, so
CUDA's allocator peak checks the estimate's ``peak``). Dry run: tiny-llama in fp32 at micro-batch 8 on the CPU.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_kit.kit import Context

TERMS = ("weights", "gradients", "optimizer", "activations", "total")
# the LLAMAS["100m"] shape of models.py as a --model_config file; train sizes its vocabulary to the shipped corpus'
# tokenizer (91 words), so this is 76M parameters in its layers
LLAMA_76M = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=768, intermediate_size=2048,
                 num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512,
                 tie_word_embeddings=True)  # fmt: skip
TINY = ["--task", "causal-lm", "--model_config", "tiny-llama"]

# What counts as clearly wrong (a problem); everything else is only reported:
# - weights, gradients, optimizer states off by more than 5 %: these are exact byte counts (within 0.1 % on the CPU,
#   docs/estimate.md); a wrong dtype or sharding factor is off by 50 % or more.
# - the total off by more than 25 %: the planner's target is 15 %, and bf16 jobs are known to come out ~15 % low.
# - activations below -30 % or above +100 %: bf16 is known at -18 % (norms and softmax saved in fp32), and CUDA's fused
#   attention saves less than the CPU terms of the formula, so an overestimate is expected, a factor of two is not.
# - no autocast weight copies measured in a bf16/fp16 single or DDP job: autocast casts every Linear weight, so the
#   measurement has counted them with the activations instead (they are in no term of the estimate).
# - cuda_peak above 1.25 x the estimated peak + 64 MiB: the planner would call a job fitting that does not (64 MiB
#   for what CUDA libraries allocate through torch's allocator, cuBLAS's workspace, not part of any formula).
STATE_LIMIT, TOTAL_LIMIT, ACTIVATIONS_RANGE = 0.05, 0.25, (-0.30, 1.00)
PEAK_FACTOR, PEAK_ALLOWANCE = 1.25, 64 * 2**20


def run(ctx: Context) -> None:
    if ctx.cuda:
        config = ctx.work / "llama76m.json"
        config.write_text(json.dumps(LLAMA_76M, indent=1))
        jobs = {
            "tiny_llama_bf16": [*TINY, "--bf16"],
            "llama76m_bf16": [
                "--task", "causal-lm", "--model_config", str(config), "--bf16",
                "--per_device_train_batch_size", "8", "--max_seq_length", "256",
            ],
        }  # fmt: skip
    else:
        jobs = {"tiny_llama_fp32": [*TINY, "--per_device_train_batch_size", "8"]}
    ctx.record(jobs={name: " ".join(flags) for name, flags in jobs.items()})
    for name, flags in jobs.items():
        _measure(ctx, name, flags)


def _command() -> list[str]:
    """The CLI: the ``trainer-ext`` console script of this interpreter's environment when it has one."""
    script = shutil.which("trainer-ext", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "trainer_ext"]


def _measure(ctx: Context, name: str, flags: list[str]) -> None:
    """One ``estimate --measure --json`` run; its figures recorded under ``name``, its clear misses as problems."""
    out = ctx.work / f"{name}.json"
    started = time.perf_counter()
    ctx.run([*_command(), "estimate", *flags, "--measure", "--json", str(out)], timeout=75, label=f"estimate {name}")
    seconds = time.perf_counter() - started
    document = json.loads(out.read_text())
    estimated, measured, setup = document["estimated"], document["measured"] or {}, document.get("setup", {})
    errors = {term: _error(estimated.get(term), measured.get(term)) for term in TERMS}
    figures: dict[str, Any] = {
        "seconds": round(seconds, 1),
        "setup": {k: setup.get(k) for k in ("strategy", "precision", "micro_batch", "seq_len", "world_size")},
        "estimated": {term: int(estimated[term]) for term in (*TERMS, "peak")},
        "measured": {term: int(measured.get(term, 0)) for term in TERMS},
        "error_pct": {term: None if e is None else round(100 * e, 1) for term, e in errors.items()},
        "weight_copies": int(measured.get("weight_copies", 0)),
    }
    if "cuda_peak" in measured:
        figures["cuda_peak"] = int(measured["cuda_peak"])
        figures["peak_error_pct"] = round(100 * _error(estimated["peak"], measured["cuda_peak"]), 1)
    ctx.record(**{name: figures})

    missing = [term for term in TERMS if not measured.get(term)]
    ctx.check(not missing, f"{name}: the measurement has no {', '.join(missing)}")
    for term in ("weights", "gradients", "optimizer"):
        e = errors[term]
        ctx.check(e is None or abs(e) <= STATE_LIMIT, f"{name}: {term} estimated {_pair(estimated, measured, term)}")
    e = errors["total"]
    ctx.check(e is None or abs(e) <= TOTAL_LIMIT, f"{name}: total estimated {_pair(estimated, measured, 'total')}")
    e = errors["activations"]
    low, high = ACTIVATIONS_RANGE
    ok = e is None or low <= e <= high
    ctx.check(ok, f"{name}: activations estimated {_pair(estimated, measured, 'activations')}")
    autocast = setup.get("precision") in ("bf16", "fp16") and setup.get("strategy") in ("single", "ddp")
    ctx.check(
        not autocast or figures["weight_copies"] > 0,
        f"{name}: no autocast weight copies measured under {setup.get('precision')}: they were counted as activations",
    )
    if ctx.cuda:
        peak = measured.get("cuda_peak")
        ctx.check(peak is not None, f"{name}: the measuring run on CUDA reported no cuda_peak")
        if peak is not None:
            ctx.check(
                peak <= PEAK_FACTOR * estimated["peak"] + PEAK_ALLOWANCE,
                f"{name}: cuda_peak {_mib(peak)} over the estimated peak {_mib(estimated['peak'])} "
                f"({figures['peak_error_pct']:+.1f}%): the estimate would call this job fitting where it does not",
            )


def _error(estimated: Any, measured: Any) -> float | None:
    """(estimated - measured) / measured; None without a measurement."""
    if not measured or estimated is None:
        return None
    return (estimated - measured) / measured


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _pair(estimated: dict, measured: dict, term: str) -> str:
    e = _error(estimated[term], measured[term])
    return f"{_mib(estimated[term])} vs {_mib(measured[term])} measured ({100 * e:+.1f}%)"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def summarize(f: dict[str, Any]) -> list[str]:
    lines = []
    for name in f.get("jobs", {}):
        job = f.get(name)
        if not isinstance(job, dict):
            lines.append(f"{name}: not measured")
            continue
        s = job.get("setup", {})
        terms = ", ".join(
            f"{term} {_mib(job['estimated'][term])}/{_mib(job['measured'][term])} ({_pct(job['error_pct'][term])})"
            for term in TERMS
        )
        line = (
            f"{name} ({s.get('strategy')}, {'fp32' if s.get('precision') == 'no' else s.get('precision')}, {s.get('micro_batch')} x {s.get('seq_len')}, "
            f"{job['seconds']} s) estimated/measured: {terms}"
        )
        if job.get("weight_copies"):
            line += f"; autocast weight copies {_mib(job['weight_copies'])}"
        if "cuda_peak" in job:
            line += (
                f"; peak {_mib(job['estimated']['peak'])} vs cuda_peak {_mib(job['cuda_peak'])} "
                f"({job['peak_error_pct']:+.1f}%)"
            )
        lines.append(line)
    return lines
