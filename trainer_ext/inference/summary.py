"""The placement summary: which modules went where, and the memory their weights take on each device."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from trainer_ext.inference.devices import Device, device_label, device_order
from trainer_ext.inference.inventory import Inventory
from trainer_ext.inference.plan import Plan
from trainer_ext.values import format_size


@dataclass
class DispatchRecord:
    """What a dispatch did, kept on the model (``model._trainer_ext_dispatch``) for the summary."""

    model_name: str
    entries: dict[Device, list[str]] = field(default_factory=dict)
    weights: dict[Device, int] = field(default_factory=dict)
    budgets: dict[Device, int] | None = None
    main: Device = "cpu"
    offload_dir: str | None = None
    largest_fetch: int = 0

    @classmethod
    def build(
        cls,
        model: nn.Module,
        inventory: Inventory,
        plan: Plan,
        budgets: dict[Device, int] | None,
        offload_dir: str | None,
    ) -> DispatchRecord:
        record = cls(type(model).__name__, budgets=budgets, main=plan.main, offload_dir=offload_dir)
        for key, device in plan.device_map.items():
            record.entries.setdefault(device, []).append(key)
        for group in inventory.groups:
            device = plan.storage[group.name]
            record.weights[device] = record.weights.get(device, 0) + group.nbytes
        fetched: dict[str, int] = {}
        for group in inventory.groups:
            for slot in group.slots:
                if plan.fetched(slot, group):
                    fetched[slot.module_name] = fetched.get(slot.module_name, 0) + group.nbytes
        record.largest_fetch = max(fetched.values(), default=0)
        return record


def compress_names(names: list[str]) -> list[str]:
    """``model.layers.0``, ``model.layers.1``, ``model.layers.2`` -> ``model.layers.0-2``."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # (prefix, first, last)
    for name in [*names, None]:
        match = re.fullmatch(r"(.*)\.(\d+)", name) if name is not None else None
        if run and match and match.group(1) == run[0] and int(match.group(2)) == run[2] + 1:
            run = (run[0], run[1], run[2] + 1)
            continue
        if run:
            out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] > run[1] else ""))
            run = None
        if match:
            run = (match.group(1), int(match.group(2)), int(match.group(2)))
        elif name is not None:
            out.append(name if name else "(whole model)")
    return out


def dispatch_summary(model: nn.Module) -> str:
    """The placement summary of a dispatched model, as printed by ``dispatch_model``."""
    record: DispatchRecord | None = getattr(model, "_trainer_ext_dispatch", None)
    if record is None:
        return f"{type(model).__name__} is not dispatched"
    devices = sorted(set(record.entries) | set(record.weights), key=device_order)
    total = sum(record.weights.values())
    lines = [f"trainer_ext dispatch: {record.model_name}, {format_size(total)} of weights on {len(devices)} device(s)"]
    rows = [("device", "weights", "budget", "modules")]
    for device in devices:
        budget = record.budgets.get(device) if record.budgets else None
        shown = "-" if budget is None or budget >= 2**60 else format_size(budget)
        names = ", ".join(compress_names(record.entries.get(device, []))) or "(buffers of the modules run here)"
        rows.append((device_label(device), format_size(record.weights.get(device, 0)), shown, names))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    offloaded = [d for d in devices if d == "disk" or (d == "cpu" and record.main != "cpu")]
    if offloaded:
        where = " and ".join(device_label(d) for d in offloaded)
        lines.append(
            f"  {where} modules run on {device_label(record.main)}: their weights are loaded there right before "
            f"each forward and released after (largest: {format_size(record.largest_fetch)})"
        )
    if record.offload_dir:
        lines.append(f"  disk weights: memory-mapped safetensors in {record.offload_dir}")
    if torch.cuda.is_available():
        gpus = [d for d in devices if isinstance(d, int)]
        used = ", ".join(f"cuda:{d} {format_size(torch.cuda.memory_allocated(d))}" for d in gpus)
        if used:
            lines.append(f"  GPU memory allocated now: {used}")
    return "\n".join(lines)
