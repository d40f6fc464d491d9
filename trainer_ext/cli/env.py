"""``trainer-ext env``: versions, devices and the launch config in use, ready to paste into a bug report.

Versions of optional packages come from their installed metadata, so nothing optional is imported
(and accelerate, which trainer_ext never uses, is only reported as installed or not).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from importlib import metadata

from trainer_ext import __version__
from trainer_ext.cli.launch.config_file import find_config_file, read_config_file
from trainer_ext.env_vars import LOCAL_RANK, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE

PACKAGES = ("transformers", "datasets", "safetensors", "deepspeed", "peft")
ENV_PREFIXES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_", "GLOO_", "TORCH_", "ACCELERATE_", "TRAINER_EXT_")
ENV_NAMES = (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, "SLURM_JOB_ID", "SLURM_NNODES")


def package_version(name: str) -> str:
    """The installed version of ``name``, or 'not installed' (read from metadata, never imported)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _memory_gib() -> str:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            info = {line.split(":")[0]: int(line.split()[1]) for line in handle if line.split()[1:]}
        return f"{info['MemTotal'] / 2**20:.1f} GiB total, {info.get('MemAvailable', 0) / 2**20:.1f} GiB available"
    except (OSError, KeyError, ValueError):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return f"{pages * size / 2**30:.1f} GiB total"


def torch_lines() -> list[str]:
    """torch, its CUDA/NCCL builds and every visible GPU with its memory."""
    import torch

    lines = [f"torch: {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})"]
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "unknown"
        lines.append(f"NCCL: {nccl}")
        lines.append(f"GPUs: {torch.cuda.device_count()}")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            lines.append(
                f"  cuda:{i}: {p.name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free), compute capability "
                f"{p.major}.{p.minor}, bf16 {'yes' if p.major >= 8 else 'no'}"
            )
    else:
        lines.append("NCCL: not available (no CUDA)")
        lines.append("GPUs: none visible to torch")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        lines.append("MPS (Apple GPU): available")
    lines.append(
        f"distributed backends: gloo {'yes' if torch.distributed.is_gloo_available() else 'no'}, nccl "
        f"{'yes' if torch.distributed.is_nccl_available() else 'no'}"
    )
    return lines


def config_lines() -> list[str]:
    """Which launch config a plain ``trainer-ext launch`` would read, and what it holds."""
    path, how = find_config_file(None)
    if path is None:
        return [f"launch config: {how}"]
    lines = [f"launch config: {path} ({how})"]
    if path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        lines += ["  " + line for line in text if line.strip() and not line.startswith("#")]
    config = read_config_file(path)
    lines += [f"  problem: {p}" for p in config.problems]
    if config.ignored:
        lines.append(f"  ignored keys: {', '.join(config.ignored)}")
    return lines


def report() -> str:
    """The whole report as text."""
    cpus = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    lines = [
        f"trainer_ext: {__version__}",
        f"python: {platform.python_version()} ({sys.executable})",
        f"platform: {platform.platform()}",
        *torch_lines(),
        *(f"{name}: {package_version(name)}" for name in PACKAGES),
        f"accelerate: {package_version('accelerate')} (never imported by trainer_ext)",
        f"CPUs: {cpus} ({usable} usable by this process)",
        f"RAM: {_memory_gib()}",
    ]
    variables = sorted(k for k in os.environ if k in ENV_NAMES or k.startswith(ENV_PREFIXES))
    lines.append("environment: " + (", ".join(f"{k}={os.environ[k]}" for k in variables) or "none of note"))
    lines += config_lines()
    return "\n".join(f"- {line}" if not line.startswith("  ") else line for line in lines)


def run_env(argv: Sequence[str]) -> int:
    """``trainer-ext env``: print the report."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: trainer-ext env\n\nPrint versions, devices and the launch config in use, for bug reports.")
        return 0
    if argv:
        from trainer_ext.errors import ConfigError

        raise ConfigError(f"env takes no arguments, got {' '.join(argv)}")
    print(report())
    return 0
