"""Forward hooks that make a model spread over devices run as if it were on one.

Around a module's forward a :class:`DispatchHook` may (1) move the inputs to the device the module runs
on, (2) bring the module's offloaded weights there (from the CPU, another GPU or a memory-mapped file)
and put the placeholders back afterwards, so only one module's offloaded weights are held at a time,
and (3) on the root module, return the outputs on the device the inputs came from. Objects that are
not tensors (a KV cache, a config) pass through untouched: each layer's cache stays where it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from trainer_ext.inference.inventory import Slot

HOOK_ATTR = "_trainer_ext_dispatch_hook"


class Source(Protocol):
    """Something that can produce a tensor on a device: a :class:`~.offload.DiskTensor` or a resident one."""

    def load(self, device: torch.device) -> torch.Tensor: ...

    def owns(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` is the source's own memory (no copy), so holding on to it costs nothing."""
        ...


@dataclasses.dataclass
class Resident:
    """A tensor held in memory on another device than the one it runs on (CPU offload, split ties)."""

    tensor: torch.Tensor

    def load(self, device: torch.device) -> torch.Tensor:
        return self.tensor.to(device)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor is self.tensor


def send_to_device(obj: Any, device: torch.device, skip_keys: Iterable[str] = ()) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts, ModelOutputs) on ``device``; others as is."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(send_to_device(v, device) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(send_to_device(v, device) for v in obj)
    if isinstance(obj, Mapping):
        moved = {k: v if k in skip_keys else send_to_device(v, device) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        return type(obj)(**moved) if dataclasses.is_dataclass(obj) else type(obj)(moved)
    return obj


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)


@dataclasses.dataclass
class Fetch:
    """One offloaded slot of a module: where its tensor comes from and where it runs."""

    slot: Slot
    source: Source
    device: torch.device
    placeholder: torch.Tensor
    _last: tuple[torch.Tensor, torch.Tensor] | None = dataclasses.field(default=None, repr=False)

    def value(self) -> torch.Tensor:
        """The tensor to put in the slot for one forward (the same Parameter again for an unchanged view)."""
        tensor = self.source.load(self.device)
        if self._last is not None and self._last[0] is tensor:
            return self._last[1]
        value = nn.Parameter(tensor, requires_grad=False) if self.slot.is_param else tensor
        # keep only what costs no memory: a copy (to a GPU, or cast) must be freed after the forward
        self._last = (tensor, value) if self.source.owns(tensor) else None
        return value


class DispatchHook:
    """What happens around one module's forward (see the module docstring).

    ``io_same_device`` is read on every call: transformers' ``generate`` sets it on an encoder's
    ``_hf_hook`` so that encoder outputs come back on the inputs' device.
    """

    def __init__(
        self,
        input_device: torch.device | None = None,
        fetches: Iterable[Fetch] = (),
        io_same_device: bool = False,
        skip_keys: Iterable[str] = (),
    ) -> None:
        self.input_device = input_device
        self.fetches = list(fetches)
        self.io_same_device = io_same_device
        self.skip_keys = frozenset(skip_keys)
        self._callers: list[torch.device | None] = []
        self.handles: list[Any] = []

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.io_same_device:
            self._callers.append(next((t.device for t in _tensors((args, kwargs))), None))
        if self.input_device is not None:
            args = send_to_device(args, self.input_device)
            kwargs = send_to_device(kwargs, self.input_device, self.skip_keys)
        for fetch in self.fetches:
            fetch.slot.set(fetch.value())
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        for fetch in self.fetches:
            fetch.slot.set(fetch.placeholder)
        if self.io_same_device and self._callers:
            device = self._callers.pop()
            if device is not None:
                output = send_to_device(output, device)
        return output

    def attach(self, module: nn.Module) -> None:
        """Register on ``module``; always_call so offloaded weights are released even when forward raises."""
        self.handles = [
            module.register_forward_pre_hook(self.pre_forward, with_kwargs=True),
            module.register_forward_hook(self.post_forward, with_kwargs=True, always_call=True),
        ]
        setattr(module, HOOK_ATTR, self)

    def detach(self, module: nn.Module) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if getattr(module, HOOK_ATTR, None) is self:
            delattr(module, HOOK_ATTR)


def is_dispatched(model: nn.Module) -> bool:
    """True when dispatch hooks are installed somewhere in ``model``."""
    return any(hasattr(m, HOOK_ATTR) for m in model.modules())


def remove_hooks(model: nn.Module) -> None:
    """Uninstall every dispatch hook (offloaded weights stay where they are: on meta placeholders)."""
    for module in model.modules():
        hook = getattr(module, HOOK_ATTR, None)
        if hook is not None:
            hook.detach(module)
        if isinstance(getattr(module, "_hf_hook", None), DispatchHook):
            del module._hf_hook
