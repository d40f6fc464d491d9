"""Device names and the default memory budget of each device (sizes are read by :mod:`trainer_ext.values`).

A device map's values are what transformers' ``hf_device_map`` holds: an ``int`` for a GPU (its CUDA
index), ``"cpu"`` or ``"disk"``. On input we also accept ``"cuda:0"``, ``"cuda"``, ``torch.device``
objects and ``"CPU"``; :func:`normalize_device` turns each into the stored form.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

import torch

from trainer_ext import values
from trainer_ext.errors import ConfigError

Device = int | str  # a GPU index, "cpu" or "disk"

# Default budgets keep this fraction of the free memory back for activations, the CUDA context and the
# allocator's fragmentation (and, on CPU, for everything else the process and the machine do).
SAFETY_MARGIN = 0.10


def normalize_device(device: int | str | torch.device) -> Device:
    """The stored form of a device name (GPU index, "cpu", "disk"); a ConfigError names the valid forms."""
    if isinstance(device, bool):
        raise _unknown_device(device)
    if isinstance(device, int):
        if device < 0:
            raise _unknown_device(device)
        return device
    if isinstance(device, torch.device):
        device = str(device)
    if isinstance(device, str):
        text = device.strip().lower()
        if text in ("cpu", "disk"):
            return text
        if text == "cuda":
            return 0
        match = re.fullmatch(r"(?:cuda:)?(\d+)", text)
        if match:
            return int(match.group(1))
    raise _unknown_device(device)


def _unknown_device(device: object) -> ConfigError:
    return ConfigError(
        f"unknown device {device!r} in the device map or max_memory; use a GPU index (0 or 'cuda:0'), 'cpu' or 'disk'"
    )


def torch_device(device: Device) -> torch.device:
    """The torch device that holds or runs a placement ("disk" has none: its weights run elsewhere)."""
    if isinstance(device, int):
        return torch.device("cuda", device)
    if device == "cpu":
        return torch.device("cpu")
    raise ValueError(f"{device!r} is not a torch device")


def device_label(device: Device) -> str:
    """How a placement is printed: ``cuda:0``, ``cpu``, ``disk``."""
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def device_order(device: Device) -> tuple[int, int]:
    """Sort key: GPUs by index, then the CPU, then disk (the order in which devices are filled)."""
    if isinstance(device, int):
        return (0, device)
    return (1, 0) if device == "cpu" else (2, 0)


def main_device(devices: Iterable[Device]) -> Device:
    """Where offloaded (CPU and disk) modules run by default: the first GPU, else the CPU."""
    gpus = [d for d in devices if isinstance(d, int)]
    return min(gpus) if gpus else "cpu"


def parse_size(value: int | float | str) -> int:
    """Bytes of a memory budget: ``1024``, ``"2MB"`` (2*10**6), ``"2MiB"`` (2*2**20); see :func:`.values.parse_size`."""
    return values.parse_size(value, "memory size")


def parse_max_memory(max_memory: Mapping[int | str | torch.device, int | float | str]) -> dict[Device, int]:
    """A user's ``max_memory`` as ``{device: bytes}`` in filling order; only the devices named may be used."""
    budgets: dict[Device, int] = {}
    for key, value in max_memory.items():
        device = normalize_device(key)
        if device in budgets:
            raise ConfigError(f"max_memory names {device_label(device)} twice ({key!r}); keep one entry")
        budgets[device] = parse_size(value)
    return dict(sorted(budgets.items(), key=lambda item: device_order(item[0])))


def available_cpu_memory() -> int:
    """Bytes of RAM available to new allocations (``MemAvailable``), from /proc/meminfo or sysconf."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def rank_gpus(gpu_count: int, local_rank: int, local_world_size: int) -> tuple[list[int], int]:
    """This rank's share of the node's GPUs and how many ranks share each of them.

    With a process group active each rank gets its own device map (research B19): the visible GPUs are
    split evenly among the local ranks; with more ranks than GPUs, ranks share a GPU and its budget.
    """
    if gpu_count == 0:
        return [], 1
    per_rank = gpu_count // max(1, local_world_size)
    if per_rank >= 1:
        return list(range(local_rank * per_rank, (local_rank + 1) * per_rank)), 1
    sharing = -(-local_world_size // gpu_count)
    return [local_rank % gpu_count], sharing


def default_max_memory(local_rank: int = 0, local_world_size: int = 1) -> dict[Device, int]:
    """Free memory minus :data:`SAFETY_MARGIN` on each of this rank's GPUs, then on the CPU; no disk."""
    budgets: dict[Device, int] = {}
    if torch.cuda.is_available():
        gpus, sharing = rank_gpus(torch.cuda.device_count(), local_rank, local_world_size)
        for index in gpus:
            free, _total = torch.cuda.mem_get_info(index)
            budgets[index] = int(free * (1 - SAFETY_MARGIN)) // sharing
    budgets["cpu"] = int(available_cpu_memory() * (1 - SAFETY_MARGIN)) // max(1, local_world_size)
    return budgets


def resolve_max_memory(max_memory: Mapping | None) -> dict[Device, int]:
    """The user's budgets, or the defaults for this process (its share of the node when distributed)."""
    if max_memory is not None:
        return parse_max_memory(max_memory)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from trainer_ext.distributed.state import detect_topology

        topology = detect_topology()
        return default_max_memory(topology.local_rank, topology.local_world_size)
    return default_max_memory()
