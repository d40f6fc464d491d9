"""The benchmark suite: one model, one data set, trained by each runner; a table of speed and memory.

    python -m benchmarks.run [--config tiny|small|gpu-1b] [--steps N] [--repeats R] [--torch_compile] [--fsdp]
                             [--json out.json]

Runners: a plain PyTorch loop (the reference), ``trainer_ext.Accelerator`` in a hand-written loop,
``trainer_ext.Trainer``, and transformers' stock Trainer when accelerate happens to be installed.
Each runner does the same work per optimizer step (forward, backward, clip to 1.0, AdamW, linear LR
schedule, zero_grad) on the same batches. Every run is a fresh subprocess of this script, so peak
memory and time to the first step are the runner's own; runners are interleaved and the best of
``--repeats`` is kept, which makes the ratios robust to machine noise; the ``spread`` column says how far one
runner's own repeats fell apart, the margin below which a ratio's difference from 1 means nothing.

``--fsdp``: every runner trains under FSDP2 on one process (a process group of world size 1, each child started by
``torch.distributed.run``): the plain loops shard each decoder layer and the root with ``fully_shard`` themselves,
the Accelerator and trainer_ext's Trainer take ``configs/fsdp/full_shard.yaml``, transformers' Trainer its own
``fsdp_config`` of the same settings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIGS: dict[str, dict[str, Any]] = {
    # runs in CI in well under a minute on 2 cores
    "tiny": dict(hidden_size=128, intermediate_size=256, layers=2, heads=4, vocab=1024, seq=64, batch=8, steps=60),
    "small": dict(hidden_size=256, intermediate_size=768, layers=4, heads=8, vocab=4096, seq=128, batch=8, steps=40),
    # a Llama-style decoder of about 1.1B parameters, bf16, sequence 2048 (for the lent GPU)
    "gpu-1b": dict(
        hidden_size=2048, intermediate_size=5632, layers=22, heads=32, vocab=32000, seq=2048, batch=4, steps=30
    ),
}
RUNNERS = ("plain", "plain-hf", "accelerator", "trainer", "stock-trainer")
FSDP_PRESET = ROOT / "configs" / "fsdp" / "full_shard.yaml"
# transformers' Trainer (through accelerate) with the preset's settings: FSDP2, one unit per decoder layer (its
# fsdp_config reads JSON, not YAML)
STOCK_FSDP_CONFIG = {
    "version": 2,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    "reshard_after_forward": True,
}
# accelerate enables FSDP on GPUs only: on the CPU transformers' Trainer given fsdp_config runs plain DDP, so it is
# left out of FSDP comparisons there (and a stock run that did not shard is refused, never reported as FSDP)
STOCK_FSDP_ON_CPU = (
    "transformers' Trainer under FSDP on the CPU: accelerate enables FSDP on GPUs only (it would run DDP)"
)
# dense bf16 peak FLOP/s (SXM parts; the H200 has the H100's compute)
PEAK_BF16_FLOPS = {
    "H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12,
}  # fmt: skip


def _model_and_data(cfg: dict[str, Any], n_samples: int, device: Any = "cpu"):
    """The config's Llama, its weights made on ``device`` (a GPU initialises a 1B model in a second, the CPU in
    tens of seconds), and ``n_samples`` random sequences."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"],
        max_position_embeddings=cfg["seq"],
        attn_implementation="sdpa",
    )
    with torch.device(device):
        model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (n_samples, cfg["seq"]), generator=g)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}).with_format("torch")
    return model, data


class _Clock:
    """Step timestamps: time to the first step, and the steady rate after the warm-up steps. ``observer`` (set by
    ``--count_calls``) hears of every step: ``observer(step, warmup)``."""

    observer: Any = None

    def __init__(self, warmup: int) -> None:
        self.t0 = time.perf_counter()
        self.warmup, self.first, self.start, self.end, self.steps = warmup, None, None, None, 0
        self.cpu_start = self.cpu_end = 0.0  # this process's CPU time (every thread) over the measured steps

    def tick(self, sync: Any = None) -> None:
        if sync is not None:
            sync()
        now = time.perf_counter()
        self.steps += 1
        if self.steps == 1:
            self.first = now - self.t0
        if self.steps == self.warmup:
            self.start, self.cpu_start = now, time.process_time()
        self.end, self.cpu_end = now, time.process_time()
        if _Clock.observer is not None:
            _Clock.observer(self.steps, self.warmup)

    def rate(self) -> float:
        return (self.steps - self.warmup) / (self.end - self.start)

    def cpu_per_step(self) -> float:
        """CPU seconds this process spent per measured step: the work done, whatever else ran on the machine."""
        return (self.cpu_end - self.cpu_start) / (self.steps - self.warmup)


def hf_param_groups(model: Any) -> list[dict[str, Any]]:
    """The parameters in the two groups transformers' Trainer builds its optimizer on (weight decay and none).

    Under weight decay 0 they differ in nothing but their number, which still costs: an optimizer steps its groups
    one after the other, and DeepSpeed's ZeRO-1/2 steps, norms and all-gathers each group on its own.
    """
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))  # self is not read
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def shard_model(model: Any, bf16: bool) -> Any:
    """FSDP2 as a hand-written loop applies it: ``fully_shard`` on each decoder layer, then the root; bf16
    parameters in forward/backward when ``bf16`` (in place of autocast), gradients reduced in float32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def free_port() -> int:
    """A free TCP port on loopback (for a launch's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_args(nproc: int) -> list[str]:
    """``-m torch.distributed.run`` for ``nproc`` processes meeting on loopback at a free port."""
    return [
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
    ]


def last_json(stdout: str) -> dict[str, Any]:
    """The result a child printed: its last stdout line that is a JSON object (a launcher may print around it);
    ValueError when it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise ValueError("the child printed no JSON result")
    return json.loads(lines[-1])


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the named GPU, None for one not in ``PEAK_BF16_FLOPS`` (and for the CPU)."""
    return next((flops for name, flops in PEAK_BF16_FLOPS.items() if name in device_name), None)


def peak_memory_mb(device: Any) -> float:
    """This process's peak memory: CUDA's allocator peak on a GPU, the resident set's peak on the CPU."""
    import resource

    import torch

    if getattr(device, "type", device) == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sync_fn(device: Any) -> Any:
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else None


def accelerator_loop(
    accelerator: Any, model: Any, data: Any, cfg: dict[str, Any], steps: int, clock: _Clock, device: Any
) -> None:
    """The hand-written accelerate-style loop: the same work per step as the plain loop."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    loader = torch.utils.data.DataLoader(data, batch_size=cfg["batch"])
    fused = device.type == "cuda" and accelerator.distributed_type != "DEEPSPEED"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=fused)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        clock.tick(_sync_fn(device))


def trainer_arguments(args_cls: Any, cfg: dict[str, Any], steps: int, device: Any, bf16: bool, **extra: Any) -> Any:
    """TrainingArguments for the same work per step as the plain loop (one log at the end, no saves)."""
    return args_cls(
        output_dir=str(ROOT / "benchmarks" / "results" / "trainer_output"),
        per_device_train_batch_size=cfg["batch"],
        max_steps=steps,
        learning_rate=1e-4,
        weight_decay=0.0,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        bf16=bf16,
        logging_steps=steps,  # one log at the end: a real run logs every few hundred steps
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        use_cpu=device.type == "cpu",
        **extra,
    )


def has_cuda() -> bool:
    """Whether torch sees a GPU here (children then run on it unless ``--cpu``)."""
    import torch

    return torch.cuda.is_available()


def best_of_interleaved(names: list[str], repeats: int, launch: Any) -> dict[str, dict[str, Any]]:
    """Each runner ``repeats`` times, interleaved (so slow drift of the machine hits every runner alike); the
    fastest run of each, with ``spread``: (fastest - slowest) / fastest over its repeats, the noise to read its
    ratio against."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(repeats):
        for name in names:
            runs.setdefault(name, []).append(launch(name))
    results = {}
    for name, rs in runs.items():
        rates = [r["steps_per_s"] for r in rs]
        best = max(rs, key=lambda r: r["steps_per_s"])
        results[name] = {**best, "rates": rates, "spread": (max(rates) - min(rates)) / max(rates)}
        if all("cpu_s_per_step" in r for r in rs):  # the least CPU time of the repeats, as the best rate
            results[name]["cpu_s_per_step"] = min(r["cpu_s_per_step"] for r in rs)
    return results


def spread_text(r: dict[str, Any]) -> str:
    """The ``spread`` column: a percentage, or '-' for a single run."""
    return f"{100 * r['spread']:.1f}%" if len(r.get("rates", ())) > 1 else "-"


def check_stock_fsdp(trainer: Any) -> None:
    """Refuse a stock Trainer run that was asked for FSDP and does not shard (see ``STOCK_FSDP_ON_CPU``)."""
    if not trainer.is_fsdp_enabled:
        raise RuntimeError(f"not comparable: {STOCK_FSDP_ON_CPU}")


def tick_callback(clock: _Clock, device: Any) -> Any:
    """A TrainerCallback that ticks ``clock`` at every optimizer step."""
    import transformers

    sync = _sync_fn(device)

    class Tick(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick(sync)

    return Tick()


def run_plain(
    cfg: dict[str, Any],
    steps: int,
    warmup: int,
    device: Any,
    bf16: bool,
    compile_model: bool = False,
    fsdp: bool = False,
    hf_rules: bool = False,
) -> dict[str, float]:
    """The reference loop. ``hf_rules`` adds the work transformers' Trainer does by its own rules, whoever runs it:
    the loss normalised by the batch's token count (``num_items_in_batch``: a summed loss divided by the labels'
    count, another kernel path) and the optimizer's two parameter groups. ``fsdp``: the model sharded by
    :func:`shard_model` on the process group of this one process."""
    import torch
    import torch.distributed as dist
    from transformers import get_linear_schedule_with_warmup

    clock = _Clock(warmup)
    model, data = _model_and_data(cfg, steps * cfg["batch"], device)
    model.to(device).train()
    if fsdp:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        shard_model(model, bf16)
    if compile_model:
        model.compile()
    loader = torch.utils.data.DataLoader(data, batch_size=cfg["batch"], pin_memory=device.type == "cuda")
    params = hf_param_groups(model) if hf_rules else model.parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=device.type == "cuda")
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, steps)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and not fsdp)  # FSDP: its policy
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        extra = {"num_items_in_batch": batch["labels"][..., 1:].ne(-100).sum()} if hf_rules else {}
        with autocast:
            loss = model(**batch, **extra).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick(_sync_fn(device))
    return {"steps_per_s": clock.rate(), "first_step_s": clock.first}


def run_accelerator(
    cfg: dict[str, Any],
    steps: int,
    warmup: int,
    device: Any,
    bf16: bool,
    compile_model: bool = False,
    fsdp: bool = False,
) -> dict[str, float]:

    clock = _Clock(warmup)  # the framework's import is part of its time to the first step
    from trainer_ext import Accelerator

    started = time.perf_counter()
    accelerator = Accelerator(
        cpu=device.type == "cpu",
        mixed_precision="bf16" if bf16 else "no",
        fsdp_config=str(FSDP_PRESET) if fsdp else None,
    )
    setup = time.perf_counter() - started
    model, data = _model_and_data(cfg, steps * cfg["batch"], device)
    if compile_model:
        model.compile()
    accelerator_loop(accelerator, model, data, cfg, steps, clock, device)
    return {"steps_per_s": clock.rate(), "first_step_s": clock.first, "setup_s": setup}


def run_trainer(
    cfg: dict[str, Any],
    steps: int,
    warmup: int,
    device: Any,
    bf16: bool,
    compile_model: bool = False,
    fsdp: bool = False,
    stock: bool = False,
) -> dict[str, float]:
    import transformers

    clock = _Clock(warmup)  # the framework's import is part of its time to the first step
    if stock:
        trainer_cls, args_cls = transformers.Trainer, transformers.TrainingArguments
    else:
        from trainer_ext import Trainer as trainer_cls
        from trainer_ext import TrainingArguments as args_cls

    model, data = _model_and_data(cfg, steps * cfg["batch"], device)
    optim = "adamw_torch_fused" if device.type == "cuda" else "adamw_torch"
    sharding = {}
    if fsdp:
        sharding = {"fsdp": "full_shard", "fsdp_config": STOCK_FSDP_CONFIG if stock else str(FSDP_PRESET)}
    started = time.perf_counter()  # set-up: arguments, engine and Trainer (the model and data are built already)
    args = trainer_arguments(args_cls, cfg, steps, device, bf16, optim=optim, torch_compile=compile_model, **sharding)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=[tick_callback(clock, device)])
    setup = time.perf_counter() - started
    if stock and fsdp:
        check_stock_fsdp(trainer)
    trainer.train()
    return {"steps_per_s": clock.rate(), "first_step_s": clock.first, "setup_s": setup}


def _child(opts: argparse.Namespace) -> None:
    """Run one runner in this (fresh) process and print its result as JSON on the last line."""

    import datasets  # noqa: F401  (every runner needs them: imported before any clock starts)
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401

    device = torch.device("cuda" if torch.cuda.is_available() and not opts.cpu else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cfg = CONFIGS[opts.config]
    steps = opts.steps or cfg["steps"]
    bf16 = opts.bf16 if opts.bf16 is not None else device.type == "cuda"
    runner = {
        "plain": run_plain,
        "plain-hf": lambda *a: run_plain(*a, hf_rules=True),
        "accelerator": run_accelerator,
        "trainer": run_trainer,
        "stock-trainer": lambda *a: run_trainer(*a, stock=True),
    }[opts.child]
    result = runner(cfg, steps, opts.warmup, device, bf16, opts.torch_compile, opts.fsdp)
    result["peak_memory_mb"] = peak_memory_mb(device)
    result["tokens_per_s"] = result["steps_per_s"] * cfg["batch"] * cfg["seq"]
    result["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result["mfu"] = _mfu(cfg, result["tokens_per_s"], result["device"], bf16)
    print(json.dumps(result), flush=True)
    if opts.fsdp:
        # a gloo group alive at interpreter exit can abort the process ("terminate called without an active
        # exception"): every runner lets go of its group of one here
        import torch.distributed as dist

        from trainer_ext.distributed.state import destroy_process_group

        if dist.is_initialized():
            destroy_process_group()


def _mfu(cfg: dict[str, Any], tokens_per_s: float, device: str, bf16: bool) -> float | None:
    """Model FLOPs utilisation: (6N + 12·L·H·S) FLOPs per token against the GPU's bf16 peak."""
    peak = peak_bf16_flops(device)
    if peak is None or not bf16:
        return None
    h, layers, seq = cfg["hidden_size"], cfg["layers"], cfg["seq"]
    n = layers * (4 * h * h + 3 * h * cfg["intermediate_size"]) + cfg["vocab"] * h  # non-embedding + head
    return tokens_per_s * (6 * n + 12 * layers * h * seq) / peak


def child_args(module: str, name: str, opts: argparse.Namespace) -> list[str]:
    """``-m module --child name`` with the run options every child needs (config, steps, device, precision)."""
    args = ["-m", module, "--child", name, "--config", opts.config, "--warmup", str(opts.warmup)]
    if opts.steps:
        args += ["--steps", str(opts.steps)]
    if opts.cpu:
        args.append("--cpu")
    if getattr(opts, "torch_compile", False):
        args.append("--torch_compile")
    if getattr(opts, "fsdp", False):
        args.append("--fsdp")
    if opts.bf16 is not None:
        args.append("--bf16" if opts.bf16 else "--no-bf16")
    return args


def child_env() -> dict[str, str]:
    """This environment with the repository importable (children run ``-m benchmarks.…``)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _run_child(name: str, opts: argparse.Namespace) -> dict[str, Any]:
    """One runner in a fresh interpreter; under ``--fsdp`` a launched one (a process group of world size 1)."""
    launcher = torchrun_args(1) if opts.fsdp else []
    cmd = [sys.executable, *launcher, *child_args("benchmarks.run", name, opts)]
    env = child_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"runner {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return last_json(proc.stdout)


def import_times() -> dict[str, float]:
    """Seconds to import, each in a fresh interpreter (best of 3)."""
    out = {}
    for label, stmt in (
        ("import transformers", "import transformers"),
        ("import trainer_ext", "import trainer_ext"),
        ("from trainer_ext import Trainer", "from trainer_ext import Trainer"),
    ):
        code = f"import time; t = time.perf_counter(); {stmt}; print(time.perf_counter() - t)"
        runs = [
            float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
            for _ in range(3)
        ]
        out[label] = min(runs)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the config's)")
    parser.add_argument("--warmup", type=int, default=10, help="steps excluded from the rate")
    parser.add_argument("--repeats", type=int, default=3, help="best of N interleaved runs per runner")
    parser.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated subset of " + ", ".join(RUNNERS))
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="default: on for CUDA")
    parser.add_argument("--torch_compile", action="store_true", help="torch.compile the model in every runner")
    parser.add_argument(
        "--fsdp", action="store_true", help="every runner under FSDP2 on one process (torchrun, world size 1)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", choices=RUNNERS, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        _child(opts)
        return {}
    runners = [r.strip() for r in opts.runners.split(",") if r.strip()]
    unknown = sorted(set(runners) - set(RUNNERS))
    if unknown:
        parser.error(f"unknown runner: {', '.join(unknown)} (known: {', '.join(RUNNERS)})")
    if importlib.util.find_spec("accelerate") is None:  # transformers' own Trainer needs accelerate
        runners = [r for r in runners if not r.startswith("stock-")]
    if opts.fsdp and "stock-trainer" in runners and (opts.cpu or not has_cuda()):
        print(f"skipping stock-trainer: {STOCK_FSDP_ON_CPU}")
        runners.remove("stock-trainer")
    results = best_of_interleaved(runners, opts.repeats, lambda name: _run_child(name, opts))
    base = results["plain"]["steps_per_s"] if "plain" in results else None
    # the Trainers follow transformers' rules (token-count loss, two parameter groups): plain-hf does that work too
    hf_base = results["plain-hf"]["steps_per_s"] if "plain-hf" in results else None
    cfg = CONFIGS[opts.config]
    device = next(iter(results.values()))["device"]
    print(
        f"config={opts.config} ({cfg['layers']}x{cfg['hidden_size']}, seq {cfg['seq']}, batch {cfg['batch']}) "
        f"device={device} steps={opts.steps or cfg['steps']} warmup={opts.warmup} best of {opts.repeats}"
        + (" torch.compile" if opts.torch_compile else "")
        + (" FSDP2 (1 process, fully_shard per layer + root)" if opts.fsdp else "")
    )
    header = (
        f"{'runner':18} {'steps/s':>8} {'spread':>6} {'tokens/s':>10} {'ratio':>6} {'vs hf':>6} {'peak MB':>9} "
        f"{'first step s':>12} {'set-up s':>8} {'MFU':>6}"
    )
    print(header)
    for name, r in results.items():
        r["ratio_to_plain"] = r["steps_per_s"] / base if base else None
        ratio = f"{r['ratio_to_plain']:.3f}" if base else "-"
        trainer = "trainer" in name
        r["ratio_to_plain_hf"] = r["steps_per_s"] / hf_base if hf_base and trainer else None
        vs_hf = f"{r['ratio_to_plain_hf']:.3f}" if r["ratio_to_plain_hf"] else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        setup = f"{r['setup_s']:.3f}" if "setup_s" in r else "-"
        print(
            f"{name:18} {r['steps_per_s']:8.2f} {spread_text(r):>6} {r['tokens_per_s']:10.0f} {ratio:>6} {vs_hf:>6} "
            f"{r['peak_memory_mb']:9.0f} {r['first_step_s']:12.2f} {setup:>8} {mfu:>6}"
        )
    imports = import_times()
    for label, seconds in imports.items():
        print(f"{label:34} {seconds:.2f} s")
    report = {
        "config": opts.config,
        "device": device,
        "torch_compile": opts.torch_compile,
        "fsdp": opts.fsdp,
        "results": results,
        "import_s": imports,
    }
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
