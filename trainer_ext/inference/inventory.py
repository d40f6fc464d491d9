"""What a model holds: each distinct tensor once, every name it goes by, and bytes per module.

Tied weights are found by identity (``lm_head.weight is model.embed_tokens.weight`` after
``tie_weights()``), which also holds on the meta device, so no model-specific list of tied keys is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class Slot:
    """One place a tensor is registered: ``module._parameters[attr]`` or ``module._buffers[attr]``."""

    module_name: str
    module: nn.Module = field(compare=False, repr=False)
    attr: str
    is_param: bool

    @property
    def name(self) -> str:
        return f"{self.module_name}.{self.attr}" if self.module_name else self.attr

    def get(self) -> torch.Tensor:
        return (self.module._parameters if self.is_param else self.module._buffers)[self.attr]

    def set(self, value: torch.Tensor) -> None:
        (self.module._parameters if self.is_param else self.module._buffers)[self.attr] = value


@dataclass
class TensorGroup:
    """One distinct tensor: its first name, every slot holding it (more than one when tied) and its size."""

    name: str
    slots: list[Slot]
    nbytes: int
    persistent: bool

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    @property
    def tensor(self) -> torch.Tensor:
        return self.slots[0].get()


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes the tensor takes, as ``dtype`` when given and the tensor is floating point (works on meta)."""
    if dtype is not None and tensor.is_floating_point():
        return tensor.numel() * torch.empty((), dtype=dtype).element_size()
    return tensor.numel() * tensor.element_size()


class Inventory:
    """The distinct tensors of ``model`` and the bytes under every module (tied tensors counted once)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.modules: dict[str, nn.Module] = dict(model.named_modules(remove_duplicate=False))
        self.groups: list[TensorGroup] = []
        self.by_name: dict[str, TensorGroup] = {}
        self.own: dict[str, list[Slot]] = {name: [] for name in self.modules}
        by_id: dict[int, TensorGroup] = {}
        for module_name, module in self.modules.items():
            for is_param, store in ((True, module._parameters), (False, module._buffers)):
                for attr, tensor in store.items():
                    if tensor is None:
                        continue
                    slot = Slot(module_name, module, attr, is_param)
                    group = by_id.get(id(tensor))
                    if group is None:
                        persistent = is_param or attr not in module._non_persistent_buffers_set
                        group = TensorGroup(slot.name, [], tensor_bytes(tensor, dtype), persistent)
                        by_id[id(tensor)] = group
                        self.groups.append(group)
                    group.slots.append(slot)
                    self.by_name[slot.name] = group
                    self.own[module_name].append(slot)
        # groups under each module name, by position in self.groups (ordered, distinct)
        self._under: dict[str, list[int]] = {name: [] for name in self.modules}
        for index, group in enumerate(self.groups):
            for slot in group.slots:
                for prefix in _prefixes(slot.module_name):
                    under = self._under[prefix]
                    if not under or under[-1] != index:
                        under.append(index)

    def groups_under(self, name: str) -> list[TensorGroup]:
        """Distinct tensors inside module ``name`` (recursively), or the one tensor named ``name``."""
        if name in self._under:
            return [self.groups[i] for i in self._under[name]]
        return [self.by_name[name]]

    def size(self, name: str) -> int:
        """Bytes under a module or of a tensor, each distinct tensor once."""
        return sum(group.nbytes for group in self.groups_under(name))

    def largest_own_size(self) -> int:
        """The most bytes one module holds directly: what an offloaded module brings in for its forward."""
        return max((sum(self.by_name[s.name].nbytes for s in slots) for slots in self.own.values()), default=0)

    def meta_names(self) -> list[str]:
        """Names of the tensors still on the meta device (weights not loaded)."""
        return [group.name for group in self.groups if group.tensor.device.type == "meta"]


def _prefixes(module_name: str) -> list[str]:
    """``"a.b.c"`` -> ``["", "a", "a.b", "a.b.c"]``."""
    if not module_name:
        return [""]
    parts = module_name.split(".")
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


def has_own_forward(module: nn.Module) -> bool:
    """False for containers (ModuleList, ModuleDict …) whose forward is never called; hooks on them never run."""
    return type(module).forward is not nn.Module.forward
