"""``dispatch_model``: put each part of a loaded model where its device map says and make it run there.

Works the same inside a distributed job: each process dispatches its own copy over its own devices
(default budgets cover only this rank's share of the node's GPUs and RAM; offload files go to
``offload_dir/rank<N>``), e.g. for data-parallel inference with a model larger than one GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from trainer_ext.errors import ConfigError
from trainer_ext.inference.device_map import infer_map, no_split_classes
from trainer_ext.inference.devices import Device, device_label, normalize_device, resolve_max_memory, torch_device
from trainer_ext.inference.hooks import HOOK_ATTR, DispatchHook, Fetch, Resident, is_dispatched
from trainer_ext.inference.inventory import Inventory, TensorGroup, has_own_forward
from trainer_ext.inference.offload import DiskTensor, SafetensorsFiles, write_index, write_offload
from trainer_ext.inference.plan import Plan, covering_key, make_plan
from trainer_ext.inference.summary import DispatchRecord, dispatch_summary

DeviceMapArg = str | Mapping[str, int | str | torch.device]
MaxMemoryArg = Mapping[int | str | torch.device, int | float | str] | None
UNLIMITED = 2**62


def dispatch_model(
    model: nn.Module,
    device_map: DeviceMapArg = "auto",
    max_memory: MaxMemoryArg = None,
    offload_dir: str | os.PathLike | None = None,
    no_split_module_classes: Iterable[str] | None = None,
    main_device: int | str | torch.device | None = None,
    print_summary: bool = True,
) -> nn.Module:
    """Spread a model with loaded weights over GPUs, CPU and disk; returns the same model, ready to run.

    ``device_map="auto"`` fills this process's GPUs, then the CPU (then ``offload_dir``, when given)
    within ``max_memory``; a dict maps module or parameter names to ``0``/``"cuda:0"``, ``"cpu"`` or
    ``"disk"`` (disk needs ``offload_dir``). ``main_device`` is where CPU and disk modules run
    (default: the first GPU, else the CPU). Sets ``model.hf_device_map`` and prints a summary.
    """
    refuse_dispatched(model)
    inventory = Inventory(model)
    meta = inventory.meta_names()
    if meta:
        raise ConfigError(
            f"{len(meta)} tensors of the model have no data (on the meta device, e.g. {meta[0]!r}); "
            "load them with load_checkpoint_and_dispatch(model, checkpoint, ...) instead"
        )
    device_map, budgets = resolve_device_map(
        model, inventory, device_map, max_memory, no_split_module_classes, offload_dir, main_device=main_device
    )
    plan = make_plan(inventory, device_map, main_device)
    check_devices_exist(plan)
    disk_groups = [g for g in inventory.groups if plan.storage[g.name] == "disk"]
    sources: dict[str, DiskTensor] = {}
    files = SafetensorsFiles()
    folder = None
    if disk_groups:
        if offload_dir is None:
            raise ConfigError(
                f"the device map puts {len(disk_groups)} tensors on 'disk' but no offload_dir was given; pass "
                "offload_dir='some/folder' (it needs about as much free space as the weights mapped to disk)"
            )
        folder = rank_folder(os.fspath(offload_dir))
        for entry, groups in by_entry(disk_groups, plan).items():
            sources.update(write_offload(folder, entry, {g.name: g.tensor for g in groups}, files))
            for group in groups:
                set_group(group, torch.empty_like(group.tensor, device="meta"))
        write_index(folder, sources)
    for group in inventory.groups:
        if plan.storage[group.name] != "disk":
            target = torch_device(plan.storage[group.name])
            if group.tensor.device != target:
                set_group(group, group.tensor.to(target))
    finish_dispatch(model, inventory, plan, sources, budgets, folder, print_summary)
    return model


def resolve_device_map(
    model: nn.Module,
    inventory: Inventory,
    device_map: DeviceMapArg,
    max_memory: MaxMemoryArg,
    no_split_module_classes: Iterable[str] | None,
    offload_dir: str | os.PathLike | None,
    disk_free: bool = False,
    main_device: int | str | torch.device | None = None,
) -> tuple[Mapping, dict[Device, int] | None]:
    """The device map to use and the budgets behind it (``None`` for a map the user wrote)."""
    if isinstance(device_map, str):
        if device_map != "auto":
            raise ConfigError(
                f"device_map={device_map!r} is not supported: use 'auto' or a dict such as "
                "{'': 0} or {'model.embed_tokens': 0, 'model.layers': 'cpu', 'lm_head': 0}"
            )
        budgets = resolve_max_memory(max_memory)
        if (offload_dir is not None or disk_free) and "disk" not in budgets:
            budgets["disk"] = UNLIMITED
        main = normalize_device(main_device) if main_device is not None else None
        return infer_map(inventory, budgets, no_split_classes(model, no_split_module_classes), main), budgets
    if max_memory is not None:
        raise ConfigError("max_memory is only used with device_map='auto'; drop it or pass device_map='auto'")
    return device_map, None


def rank_folder(offload_dir: str) -> str:
    """``offload_dir`` itself, or ``offload_dir/rank<N>`` inside a multi-process job (ranks never share files)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return os.path.join(offload_dir, f"rank{dist.get_rank()}")
    return offload_dir


def check_devices_exist(plan: Plan) -> None:
    """A ConfigError for a GPU the map uses that this process cannot see."""
    used = set(plan.device_map.values()) | {plan.main}
    gpus = sorted(d for d in used if isinstance(d, int))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [d for d in gpus if d >= count]
    if missing:
        raise ConfigError(
            f"the device map uses {', '.join(device_label(d) for d in missing)} but this process sees "
            f"{count} GPU(s); map those modules to a visible GPU, 'cpu' or 'disk' (check CUDA_VISIBLE_DEVICES)"
        )


def set_group(group: TensorGroup, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in every slot of a (possibly tied) tensor, keeping the slots tied."""
    old = group.tensor
    if isinstance(old, nn.Parameter):
        tensor = nn.Parameter(tensor, requires_grad=old.requires_grad)
    for slot in group.slots:
        slot.set(tensor)


def by_entry(groups: list[TensorGroup], plan: Plan) -> dict[str, list[TensorGroup]]:
    """Tensors grouped by the device-map entry that places them (one offload file per entry)."""
    entries: dict[str, list[TensorGroup]] = {}
    for group in groups:
        entries.setdefault(covering_key(group.slots[0].name, plan.device_map), []).append(group)
    return entries


def finish_dispatch(
    model: nn.Module,
    inventory: Inventory,
    plan: Plan,
    disk: Mapping[str, DiskTensor],
    budgets: dict[Device, int] | None,
    offload_dir: str | None,
    print_summary: bool,
) -> None:
    """Install the hooks, set ``hf_device_map``, record and print the summary (tensors already placed)."""
    fetches: dict[str, list[Fetch]] = {}
    for group in inventory.groups:
        source = disk.get(group.name) or Resident(group.tensor)
        for slot in group.slots:
            if plan.fetched(slot, group):
                fetch = Fetch(slot, source, plan.slot_device[slot.name], slot.get())
                fetches.setdefault(slot.module_name, []).append(fetch)
    skip = getattr(model, "_skip_keys_device_placement", None) or ()
    for name in dict.fromkeys([""] + list(plan.input_devices) + list(fetches)):
        module = inventory.modules[name]
        own = fetches.get(name, [])
        if own and not has_own_forward(module):
            for fetch in own:  # a container's forward never runs: keep its tensors on their device
                set_group(inventory.by_name[fetch.slot.name], fetch.source.load(fetch.device))
            own = []
        hook = DispatchHook(plan.input_devices.get(name), own, io_same_device=not name, skip_keys=skip)
        hook.attach(module)
    encoder = model.get_encoder() if getattr(getattr(model, "config", None), "is_encoder_decoder", False) else None
    if isinstance(encoder, nn.Module) and encoder is not model:
        # transformers' generate sets encoder._hf_hook.io_same_device; without a hook it calls accelerate
        encoder._hf_hook = getattr(encoder, HOOK_ATTR, None) or _bare_hook(encoder)
    model.hf_device_map = dict(plan.device_map)
    model._trainer_ext_dispatch = DispatchRecord.build(model, inventory, plan, budgets, offload_dir)
    if print_summary:
        print(dispatch_summary(model))


def _bare_hook(module: nn.Module) -> DispatchHook:
    """A hook that does nothing until transformers switches its ``io_same_device`` on."""
    hook = DispatchHook()
    hook.attach(module)
    return hook


def refuse_dispatched(model: nn.Module) -> None:
    """A second dispatch would stack hooks on hooks; ask for a fresh model instead."""
    if is_dispatched(model):
        raise ConfigError(
            "this model is already dispatched (it has trainer_ext dispatch hooks); build or load a fresh model "
            "to place it differently"
        )
