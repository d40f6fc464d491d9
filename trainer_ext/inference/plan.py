"""From a device map to a plan: where each tensor is stored, where each module runs, what moves when.

A map key names a module (everything under it) or a single tensor; the longest key covering a name
wins, and ``""`` covers the whole model. A placement's *execution device* is the GPU itself, or for
``"cpu"`` and ``"disk"`` the main device (the first GPU in the map, else the CPU; ``main_device``
overrides). Buffers are never written to disk: an offloaded module's buffers stay on its execution
device (they are small: rotary frequencies, position ids, norms' statistics).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.inference.devices import Device, device_label, normalize_device, torch_device
from trainer_ext.inference.devices import main_device as default_main
from trainer_ext.inference.inventory import Inventory, Slot, TensorGroup, has_own_forward


@dataclass
class Plan:
    """Everything dispatch needs, computed and checked before anything is moved."""

    device_map: dict[str, Device]
    main: Device
    storage: dict[str, Device] = field(default_factory=dict)  # group name -> where the tensor lives
    slot_device: dict[str, torch.device] = field(default_factory=dict)  # slot name -> where it is used
    input_devices: dict[str, torch.device] = field(default_factory=dict)  # module name -> inputs moved to

    def execution_device(self, placement: Device) -> torch.device:
        return torch_device(placement if isinstance(placement, int) else self.main)

    def fetched(self, slot: Slot, group: TensorGroup) -> bool:
        """True when the slot's tensor is brought to its execution device right before each forward."""
        storage = self.storage[group.name]
        return storage == "disk" or torch_device(storage) != self.slot_device[slot.name]


def normalize_device_map(device_map: Mapping[str, int | str | torch.device]) -> dict[str, Device]:
    """The map with every value in stored form (GPU index, "cpu", "disk")."""
    if not isinstance(device_map, Mapping):
        raise ConfigError(
            f"device_map must be 'auto' or a dict of module names to devices, not {type(device_map).__name__}"
        )
    return {str(key): normalize_device(value) for key, value in device_map.items()}


def make_plan(
    inventory: Inventory, device_map: Mapping[str, Device], main_device: int | str | torch.device | None = None
) -> Plan:
    """Check ``device_map`` against the model and work out storage and execution device of every tensor."""
    device_map = normalize_device_map(device_map)
    _check_keys(inventory, device_map)
    main = normalize_device(main_device) if main_device is not None else default_main(device_map.values())
    if main == "disk":
        raise ConfigError("main_device cannot be 'disk': offloaded weights run on a GPU or the CPU")
    plan = Plan(device_map, main)
    placement = {}
    for group in inventory.groups:
        for slot in group.slots:
            key = covering_key(slot.name, device_map)
            if key is None:
                raise ConfigError(
                    f"the device_map does not place {slot.name!r}; add an entry for it or for a module that "
                    "holds it ('' places everything not listed)"
                )
            placement[slot.name] = device_map[key]
            plan.slot_device[slot.name] = plan.execution_device(device_map[key])
        first = group.slots[0]
        stored = placement[first.name]
        if not first.is_param and not isinstance(stored, int):
            stored = _as_device(plan.slot_device[first.name])
        plan.storage[group.name] = stored
    _plan_inputs(inventory, plan)
    return plan


def _as_device(device: torch.device) -> Device:
    return (device.index or 0) if device.type == "cuda" else "cpu"


def _check_keys(inventory: Inventory, device_map: Mapping[str, Device]) -> None:
    names = list(inventory.modules) + list(inventory.by_name)
    for key in device_map:
        if key not in inventory.modules and key not in inventory.by_name:
            raise ConfigError(
                f"the device_map names {key!r}, which is neither a module nor a parameter of "
                f"{type(inventory.model).__name__}.{did_you_mean(key, names)} "
                "(module names are those of model.named_modules())"
            )


def covering_key(name: str, device_map: Mapping[str, Device]) -> str | None:
    """The longest key that is ``name`` or one of its parents."""
    while True:
        if name in device_map:
            return name
        if not name:
            return None
        name = name.rpartition(".")[0]


def _plan_inputs(inventory: Inventory, plan: Plan) -> None:
    """Which modules move their inputs: every module key, and any module whose own tensors run elsewhere."""
    module_keys = {k: v for k, v in plan.device_map.items() if k in inventory.modules}
    for key, device in module_keys.items():
        _hook_inputs(inventory, plan, key, plan.execution_device(device), module_keys)
    for name, slots in inventory.own.items():
        devices = {plan.slot_device[slot.name] for slot in slots}
        if len(devices) > 1:
            where = ", ".join(f"{s.name} -> {device_label(_as_device(plan.slot_device[s.name]))}" for s in slots)
            raise ConfigError(
                f"the tensors of module {name!r} would run on different devices ({where}); map the module "
                "(or all of its tensors) to one device"
            )
        covering = covering_key(name, module_keys)
        runs_on = plan.execution_device(module_keys[covering]) if covering is not None else None
        if devices and runs_on not in devices:
            _hook_inputs(inventory, plan, name, devices.pop(), module_keys)


def _hook_inputs(
    inventory: Inventory, plan: Plan, name: str, device: torch.device, module_keys: Mapping[str, Device]
) -> None:
    module = inventory.modules[name]
    if has_own_forward(module):
        plan.input_devices[name] = device
        return
    prefix = name + "." if name else ""
    for child, _ in module.named_children():  # a container's forward never runs: hook its members
        if prefix + child not in module_keys:
            _hook_inputs(inventory, plan, prefix + child, device, module_keys)
