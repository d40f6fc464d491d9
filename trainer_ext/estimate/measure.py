"""What a real run holds per rank: the bytes of the tensors it keeps and the bytes it saves for backward.

:class:`MeasureCallback` rides along a real ``train`` run of the same job. Over every micro-batch it counts the
storages saved for backward (``torch.autograd.graph.saved_tensors_hooks``; parameters and their gathered copies
excluded, each storage once, the most held at once); before the second optimizer step (under DeepSpeed, which steps
inside backward: before ZeRO-1 reduces its gradients and when its torch optimizer steps, the larger count per kind),
when gradients and optimizer states all exist, it sorts the tensors the rank holds into weights (the local
parameters, their shards or partitions, and any master copies the optimizer steps), optimizer states and gradients,
each storage once. A dpo job's reference model (:attr:`MeasureCallback.reference`) is counted on its own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from transformers import TrainerCallback

MEASURED_STEP = 1  # global_step during the second optimizer step: the states of the first step exist
# attributes of an optimizer wrapper holding gradient buffers (DeepSpeed's ZeRO optimizers keep reduced gradients
# in flat partitions of their own, not in .grad)
_GRAD_WORDS = ("grad",)


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(key, bytes) of the storage under ``tensor`` (a DTensor's: its local shard's); None for meta, empty or
    storage-less tensors."""
    # tensor parallelism's layers save DTensors for backward (autograd records the ops above DTensor's dispatch): a
    # wrapper without a storage of its own, holding its local tensor
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        tensor = local
    if tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None
    if size == 0 or key == 0:
        return None
    return key, size


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds: a DTensor's local shard, a ZeRO-3 partition, or itself."""
    partition = getattr(tensor, "ds_tensor", None)  # DeepSpeed ZeRO-3 keeps the rank's partition here
    if isinstance(partition, torch.Tensor):
        return partition
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _tensors_in(value: Any, depth: int = 2) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 0 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth - 1)


def optimizer_chain(optimizer: Any) -> list[Any]:
    """The optimizer and every optimizer it wraps (``.optimizer``), outermost first."""
    chain, seen = [], set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


class _Counter:
    """Bytes per class, each storage counted once over all classes (the first class that claims it)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, kind: str, tensors: Iterable[torch.Tensor]) -> None:
        self.bytes.setdefault(kind, 0)
        for tensor in tensors:
            found = _storage(_local(tensor))
            if found is not None and found[0] not in self.seen:
                self.seen.add(found[0])
                self.bytes[kind] += found[1]


def held_bytes(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Weights, optimizer states and gradients this rank holds now, in bytes."""
    params = list(model.parameters())
    torch_optimizers = [o for o in optimizer_chain(optimizer) if isinstance(o, torch.optim.Optimizer)]
    masters = [p for o in torch_optimizers for group in o.param_groups for p in group["params"]]
    counter = _Counter()
    counter.add("weights", params + masters)
    counter.add("optimizer", (t for o in torch_optimizers for s in o.state.values() for t in _tensors_in(s)))
    grads = [p.grad for p in params + masters + [_local(p) for p in params] if p.grad is not None]
    for wrapper in optimizer_chain(optimizer):
        if isinstance(wrapper, torch.optim.Optimizer):
            continue
        for name, value in vars(wrapper).items():
            if any(word in name.lower() for word in _GRAD_WORDS):
                grads += list(_tensors_in(value))
    counter.add("gradients", grads)
    return counter.bytes


def _unhook(target: Any, name: str, hook: Any) -> None:
    if target.__dict__.get(name) is hook:
        delattr(target, name)


class _Saved:
    """One tensor saved for backward, held by the graph in its place: released (``__del__``) when the graph frees it,
    after its backward."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int, owner: SavedTensors) -> None:
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner._release(self.key)


def _unpack(saved: Any) -> Any:
    return saved.tensor if isinstance(saved, _Saved) else saved


class SavedTensors:
    """Counts the storages saved for backward while entered (each once; parameters and their casts apart).

    ``activations`` holds every storage saved; ``total`` is the most bytes saved and not yet freed at once. They
    differ when backward frees some before the forward of another microbatch saves more (a pipeline schedule runs
    several in one training step): the union of the storages would count every microbatch, and a freed storage's
    address reused by a later one only once."""

    def __init__(self) -> None:
        self.activations: dict[int, int] = {}
        self.weight_copies: dict[int, int] = {}
        self._hooks: Any = None
        self._live: dict[int, list[int]] = {}  # storage key -> [bytes, tensors saved from it the graph still holds]
        self._live_bytes = 0
        self._peak = 0

    def _pack(self, tensor: torch.Tensor) -> Any:
        found = _storage(tensor)
        if found is None:
            return tensor
        base = tensor._base if tensor._base is not None else tensor
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return tensor  # a weight, a view of one (w.T) or its gathered copy: counted with the weights
        # autocast saves its low-precision copy of a Linear weight as a view (w.T, grad_fn TBackward0): look at the
        # base. A view of a cast activation fails the next test (its cast does not come from a weight's AccumulateGrad)
        node = base.grad_fn
        if node is not None and node.name() == "ToCopyBackward0":
            source = node.next_functions[0][0] if node.next_functions else None
            if source is not None and source.name() == "torch::autograd::AccumulateGrad":
                self.weight_copies[found[0]] = found[1]  # autocast's half-precision copy of a weight
                return tensor
        key, size = found
        self.activations[key] = size
        entry = self._live.setdefault(key, [size, 0])
        if entry[1] == 0:
            self._live_bytes += size
            self._peak = max(self._peak, self._live_bytes)
        entry[1] += 1
        return _Saved(tensor, key, self)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self._live_bytes -= entry[0]
            del self._live[key]

    def __enter__(self) -> SavedTensors:
        self.activations.clear()
        self.weight_copies.clear()
        self._peak = self._live_bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return self._peak


class MeasureCallback(TrainerCallback):
    """Measures two optimizer steps and writes this rank's numbers to ``out_dir/rank<N>.json``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.saved = SavedTensors()
        self.active = False
        self.activations = 0
        self.weight_copies = 0
        self.held: dict[str, int] | None = None  # counted inside the optimizer's step (DeepSpeed), else None
        self._unhooks: list[Any] = []  # removes the step hooks still in place
        self.reference: torch.nn.Module | None = None  # a dpo job's frozen reference model (set by the worker)

    def _start(self) -> None:
        if not self.active:
            self.saved.__enter__()
            self.active = True

    def _record(self) -> None:
        if self.active:
            self.activations = max(self.activations, self.saved.total)
            self.weight_copies = max(self.weight_copies, sum(self.saved.weight_copies.values()))
            self.saved.__exit__(None, None, None)
            self.active = False

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._start()
        if state.global_step == MEASURED_STEP and model is not None and not self._unhooks and self.held is None:
            self._hook_steps(model, optimizer)

    def _hook_steps(self, model: torch.nn.Module, optimizer: Any) -> None:
        """Count the held tensors when each optimizer the outer one wraps steps, and before a ZeRO optimizer reduces
        its gradients (once each), keeping the largest count per kind. DeepSpeed steps inside backward, before
        ``on_pre_optimizer_step``: ZeRO-1 holds whole gradients when backward ends (``reduce_gradients`` then cuts
        them to the rank's partition), its torch optimizer steps once they are reduced and flattened into an fp32
        copy, and ZeRO-1/2 free them all right after. The other strategies step after the callback, which counts for
        them (and removes these hooks first)."""
        for target in optimizer_chain(optimizer)[1:]:
            for name in ("step", "reduce_gradients"):
                original = getattr(target, name, None)
                if callable(original):
                    self._hook(target, name, original, model, optimizer)

    def _hook(self, target: Any, name: str, original: Any, model: torch.nn.Module, optimizer: Any) -> None:
        def counted(*call_args: Any, **call_kwargs: Any) -> Any:
            _unhook(target, name, counted)  # once
            held = held_bytes(model, optimizer)
            self.held = {k: max(v, (self.held or {}).get(k, 0)) for k, v in held.items()}
            return original(*call_args, **call_kwargs)

        setattr(target, name, counted)
        self._unhooks.append(lambda: _unhook(target, name, counted))

    def _unhook_steps(self) -> None:
        while self._unhooks:
            self._unhooks.pop()()

    def on_substep_end(self, args, state, control, **kwargs):
        self._record()  # one micro-batch done: its saved tensors were freed by its backward
        self._start()

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._record()
        if state.global_step != MEASURED_STEP or model is None:
            return
        self._unhook_steps()
        held = self.held if self.held is not None else held_bytes(model, optimizer)
        result = {
            "weights": held.get("weights", 0),
            "gradients": held.get("gradients", 0),
            "optimizer": held.get("optimizer", 0),
            "activations": self.activations,
            "weight_copies": self.weight_copies,
        }
        if self.reference is not None:  # its own storages: a copy of the initial model, or another model
            counter = _Counter()
            counter.add("reference", self.reference.parameters())
            result["reference"] = counter.bytes["reference"]
        parts = ("weights", "gradients", "optimizer", "reference", "activations")
        result["total"] = sum(result.get(k, 0) for k in parts)
        if torch.cuda.is_available() and args.device.type == "cuda":
            result["cuda_peak"] = torch.cuda.max_memory_allocated(args.device)
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"rank{args.process_index}.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(result, handle)

    def on_train_end(self, args, state, control, **kwargs):
        self._record()
        self._unhook_steps()
