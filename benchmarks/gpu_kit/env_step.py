"""Step ``env``: the versions and the GPU the run had, and trainer_ext's public API imported without accelerate."""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

from benchmarks.gpu_kit.kit import Context, accelerate_imported, hide_accelerate, peak_bf16_flops

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "torchao", "datasets", "evaluate", "peft", "trl")


def run(ctx: Context) -> None:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    ctx.record(python=sys.version.split()[0], **versions)
    hide_accelerate()  # as where it is not installed: trainer_ext must import and work without it
    import torch

    import trainer_ext
    from trainer_ext import Accelerator, Trainer, TrainingArguments, dispatch_model  # noqa: F401

    ctx.record(trainer_ext_from=str(trainer_ext.__file__), torch_cuda=torch.version.cuda)
    ctx.check(not accelerate_imported(), "importing trainer_ext's public API tried to import accelerate")
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        ctx.record(
            device_name=name,
            device_count=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            nccl=_nccl_version(),
            bf16_supported=torch.cuda.is_bf16_supported(),
            peak_bf16_tflops=(peak_bf16_flops(name) or 0) / 1e12 or None,
        )
        ctx.check(peak_bf16_flops(name) is not None, f"no dense bf16 peak known for {name!r}: MFU is not reported")
    else:
        ctx.record(device_name="cpu", cpu_count=torch.get_num_threads())


def _nccl_version() -> str:
    """NCCL's version as torch reports it (a tuple in recent releases, an int in older ones)."""
    import torch

    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def summarize(f: dict[str, Any]) -> list[str]:
    lines = [
        f"{f.get('device_name')}"
        + (
            f", compute capability {f['capability']}, {f['memory_gib']} GiB, NCCL {f['nccl']}"
            if "capability" in f
            else ""
        )
    ]
    lines.append(f"python {f.get('python')}, CUDA {f.get('torch_cuda')}, trainer_ext from {f.get('trainer_ext_from')}")
    lines.append(", ".join(f"{p} {f.get(p) or '-'}" for p in PACKAGES))
    return lines
