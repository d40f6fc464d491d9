"""``infer_auto_device_map``: fill the GPUs in order, then the CPU, then disk, within each budget.

The model is walked from the root: a module that fits in what is left on the current device goes there
whole; one that does not is split into its children (its own parameters travel together as one unit),
unless it is a leaf or its class is in ``no_split_module_classes``, in which case the next device is
tried. Devices are never revisited, so layers stay in order and each device holds one stretch of them.

Tied weights stay together: a unit holding a tensor that another module shares is placed with that
module (in the same step, on the same device), so a tied tensor is stored once.

Room for offloaded weights: modules on the CPU (when there is a GPU) or on disk run on the *main
device* (the first GPU, else the CPU): right before a module's forward its own weights are copied
there and freed after. When the first pass offloads anything, the map is computed again with the
largest single module's own weights (usually the embedding) held back on the main device. Activations
are not estimated; the default budgets keep 10% of free memory back for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from trainer_ext.errors import ConfigError
from trainer_ext.inference.devices import Device, device_label, main_device, resolve_max_memory
from trainer_ext.inference.inventory import Inventory
from trainer_ext.values import format_size


@dataclass
class _Unit:
    """A candidate for placement: a module (``own`` False) or the tensors registered directly on one."""

    name: str
    own: bool = False

    def covers(self, tensor_name: str) -> bool:
        if self.own:
            return tensor_name.rpartition(".")[0] == self.name
        return not self.name or tensor_name.startswith(self.name + ".")


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[int | str | torch.device, int | float | str] | None = None,
    no_split_module_classes: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Device]:
    """Map module names to a GPU index, ``"cpu"`` or ``"disk"``, filling devices in order within budgets.

    ``max_memory`` (e.g. ``{0: "10GiB", "cuda:1": "10GiB", "cpu": "30GB", "disk": "200GB"}``) lists the
    devices that may be used; by default this process's GPUs and the CPU, each with its free memory
    minus 10%, and no disk. ``no_split_module_classes`` defaults to the model's ``_no_split_modules``;
    ``dtype`` sizes floating-point weights as that type (the type they will be loaded in).
    """
    return infer_map(
        Inventory(model, dtype), resolve_max_memory(max_memory), no_split_classes(model, no_split_module_classes)
    )


def no_split_classes(model: nn.Module, classes: Iterable[str] | None) -> frozenset[str]:
    if classes is None:
        classes = getattr(model, "_no_split_modules", None) or ()
    if isinstance(classes, str):
        classes = [classes]
    return frozenset(classes)


def infer_map(
    inventory: Inventory, budgets: dict[Device, int], no_split: frozenset[str], main: Device | None = None
) -> dict[str, Device]:
    """The map for these budgets; ``main`` is where offloaded modules will run (default: first GPU, else CPU)."""
    if not budgets:
        raise ConfigError("max_memory is empty: name at least one device, e.g. {'cpu': '8GB'}")
    placed = _fill(inventory, budgets, no_split)
    main = main_device(budgets) if main is None else main
    offloaded = {d for d in placed.values() if d == "disk" or (d == "cpu" and main != "cpu")}
    if offloaded and main in budgets:
        # offloaded modules run on the main device: keep room there for the largest one's own weights
        reserved = dict(budgets)
        held = inventory.largest_own_size()
        reserved[main] = max(0, budgets[main] - held)
        try:
            placed = _fill(inventory, reserved, no_split)
        except ConfigError as error:
            note = f" ({format_size(held)} of {device_label(main)} is held back for offloaded weights while they run)"
            raise ConfigError(str(error) + note) from None
    return placed


def _fill(inventory: Inventory, budgets: dict[Device, int], no_split: frozenset[str]) -> dict[str, Device]:
    devices = list(budgets)
    left = dict(budgets)
    current = 0
    pending: list[_Unit] = [_Unit("")]
    placed_groups: set[int] = set()
    placements: list[tuple[_Unit, Device]] = []
    split: list[str] = []
    while pending:
        unit = pending[0]
        bundle = [unit] + _partners(unit, pending, inventory, no_split, split)
        groups = {id(g): g for u in bundle for g in _groups(u, inventory) if id(g) not in placed_groups}
        cost = sum(g.nbytes for g in groups.values())
        while current < len(devices) and cost > left[devices[current]] and _atomic(unit, inventory, no_split):
            current += 1
        if current == len(devices):
            raise _does_not_fit(unit, cost, inventory, budgets, no_split)
        device = devices[current]
        if cost > left[device]:
            pending[:1] = _split(unit, inventory)
            split.append(unit.name)
            continue
        for member in bundle:
            pending.remove(member)
            placements.append((member, device))
        placed_groups.update(groups)
        left[device] -= cost
    return _compact(_entries(placements, inventory), split)


def _groups(unit: _Unit, inventory: Inventory) -> list:
    if unit.own:
        return [inventory.by_name[slot.name] for slot in inventory.own[unit.name]]
    return inventory.groups_under(unit.name)


def _atomic(unit: _Unit, inventory: Inventory, no_split: frozenset[str]) -> bool:
    if unit.own:
        return True
    module = inventory.modules[unit.name]
    return type(module).__name__ in no_split or not any(True for _ in module.named_children())


def _split(unit: _Unit, inventory: Inventory) -> list[_Unit]:
    """A module's parts in registration order: its own tensors (one unit), then each child."""
    module = inventory.modules[unit.name]
    prefix = unit.name + "." if unit.name else ""
    parts = [_Unit(unit.name, own=True)] if inventory.own[unit.name] else []
    return parts + [_Unit(prefix + child) for child, _ in module.named_children()]


def _partners(
    unit: _Unit, pending: list[_Unit], inventory: Inventory, no_split: frozenset[str], split: list[str]
) -> list[_Unit]:
    """Pending units (made atomic by splitting) sharing a tensor with ``unit``, transitively."""
    bundle, found = [unit], []
    for member in bundle:
        for group in _groups(member, inventory):
            for name in group.names:
                if any(u.covers(name) for u in bundle):
                    continue
                holder = next((u for u in pending if u.covers(name)), None)
                while holder is not None and not _atomic(holder, inventory, no_split):
                    at = pending.index(holder)
                    pending[at : at + 1] = _split(holder, inventory)
                    split.append(holder.name)
                    holder = next(u for u in pending if u.covers(name))
                if holder is not None and holder not in bundle:
                    bundle.append(holder)
                    found.append(holder)
    return found


def _entries(placements: list[tuple[_Unit, Device]], inventory: Inventory) -> list[tuple[str, Device]]:
    """Map keys in module order: a module's name, or each tensor name of an ``own`` unit."""
    order = {name: i for i, name in enumerate(inventory.modules)}
    placements = sorted(placements, key=lambda p: (order[p[0].name], not p[0].own))
    entries: list[tuple[str, Device]] = []
    for unit, device in placements:
        names = [slot.name for slot in inventory.own[unit.name]] if unit.own else [unit.name]
        entries.extend((name, device) for name in names)
    return entries


def _compact(entries: list[tuple[str, Device]], split: list[str]) -> dict[str, Device]:
    """Merge the parts of a split module back into one entry when they all landed on one device."""
    for name in sorted(set(split), key=lambda n: -n.count(".") - bool(n)):
        inside = [i for i, (key, _) in enumerate(entries) if not name or key.startswith(name + ".")]
        if inside and len({entries[i][1] for i in inside}) == 1:
            device, drop = entries[inside[0]][1], set(inside)
            entries = [e for i, e in enumerate(entries) if i not in drop]
            entries.insert(inside[0], (name, device))
    return dict(entries)


def _does_not_fit(
    unit: _Unit, cost: int, inventory: Inventory, budgets: dict[Device, int], no_split: frozenset[str]
) -> ConfigError:
    what = f"the parameters of {unit.name or 'the model'!r}" if unit.own else repr(unit.name or "the model")
    module = None if unit.own else inventory.modules[unit.name]
    kind = f"a {type(module).__name__}" if module is not None else "tensors"
    if type(module).__name__ in no_split:
        kind += ", kept whole because it is in no_split_module_classes"
    total = sum(g.nbytes for g in inventory.groups)
    listed = ", ".join(f"{device_label(d)} {format_size(b)}" for d, b in budgets.items())
    fix = (
        "raise the 'disk' budget"
        if "disk" in budgets
        else "allow disk offload (max_memory['disk'] = e.g. '100GB', and offload_dir=... for dispatch_model)"
    )
    return ConfigError(
        f"the model does not fit in max_memory: {what} ({kind}; {format_size(cost)} with any weights tied "
        f"to it) fits in what is left on no device. Budgets: {listed}; the whole model needs {format_size(total)}. "
        f"Raise max_memory, or {fix}."
    )
