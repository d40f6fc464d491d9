"""``load_checkpoint_and_dispatch``: build the model without weights, then read each one to its device.

The model is built inside :func:`init_empty_weights`, so its parameters live on the meta device (shape
and dtype, no memory; buffers stay real, since non-persistent ones such as rotary frequencies are
computed in ``__init__`` and not saved). The device map is computed on that empty model, and each
weight is read from the memory-mapped safetensors checkpoint straight to its GPU or into RAM. Weights
mapped to disk are not copied at all: they are read from the checkpoint's own files when their module
runs (or from ``offload_dir``, when given, e.g. to keep them on a faster disk or already cast to ``dtype``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from ..errors import ConfigError
from .devices import torch_device
from .dispatch import (
    DeviceMapArg,
    MaxMemoryArg,
    by_entry,
    check_devices_exist,
    finish_dispatch,
    rank_folder,
    refuse_dispatched,
    resolve_device_map,
    set_group,
)
from .inventory import Inventory
from .offload import DiskTensor, SafetensorsFiles, write_index, write_offload
from .plan import make_plan

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Inside, modules get their parameters on the meta device: shape and dtype, no memory.

    Buffers stay real (non-persistent ones, such as rotary frequencies, are computed in ``__init__`` and no
    checkpoint holds them); ``include_buffers=True`` puts them on meta too, which is ``with torch.device("meta")``.
    Without it a parameter moves to meta as it is registered (torch's registration hook, active in every thread
    until the block ends), so initialisers that run after registration (``reset_parameters``) cost nothing.
    """
    if include_buffers:
        with torch.device("meta"):
            yield
        return
    handle = register_module_parameter_registration_hook(_parameter_on_meta)
    try:
        yield
    finally:
        handle.remove()


def _parameter_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if param is None or param.device.type == "meta":
        return None  # kept as given (an already-empty parameter: a tied one keeps its identity)
    return type(param)(param.to("meta"), requires_grad=param.requires_grad)


def checkpoint_files(checkpoint: str | os.PathLike) -> dict[str, str]:
    """``{tensor name: file}`` of a safetensors checkpoint: a file, an index json, or a ``save_pretrained`` folder."""
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, INDEX_FILE)):
            path = os.path.join(path, INDEX_FILE)
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            path = os.path.join(path, SINGLE_FILE)
        else:
            raise ConfigError(
                f"{checkpoint} holds neither {SINGLE_FILE} nor {INDEX_FILE}; pass a folder written by "
                "save_pretrained (safetensors), a .safetensors file or its index .json"
            )
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint {checkpoint} does not exist")
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{path} has no 'weight_map'; is it a safetensors index?")
        folder = os.path.dirname(path)
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    if not path.endswith(".safetensors"):
        raise ConfigError(f"{checkpoint}: only safetensors checkpoints are supported (save_pretrained writes them)")
    return dict.fromkeys(SafetensorsFiles().keys(path), path)


def build_empty(model: nn.Module | type | transformers.PretrainedConfig, checkpoint: str | os.PathLike) -> nn.Module:
    """The model with its parameters on meta: as given, from a model class, or from a config."""
    if isinstance(model, nn.Module):
        return model
    import transformers  # only here: importing trainer_ext.dispatch stays light

    folder = os.fspath(checkpoint)
    folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
    if isinstance(model, type) and hasattr(model, "from_config") and not issubclass(model, nn.Module):
        config = transformers.AutoConfig.from_pretrained(folder)  # an Auto class: AutoModelForCausalLM …
        with init_empty_weights():
            built = model.from_config(config)
        return _with_generation_config(built, folder)
    if isinstance(model, type) and issubclass(model, nn.Module):
        if not hasattr(model, "config_class"):
            raise ConfigError(f"cannot build {model.__name__} from a checkpoint: pass an instance instead")
        config = model.config_class.from_pretrained(folder)
        model_class = model
    elif isinstance(model, transformers.PretrainedConfig):
        config = model
        architectures = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        if model_class is None:
            raise ConfigError(
                f"the config names no known model class (architectures={architectures}); pass the class or an "
                "instance built inside trainer_ext.dispatch.init_empty_weights()"
            )
    else:
        raise ConfigError(f"model must be a module, a model class or a config, not {type(model).__name__}")
    with init_empty_weights():
        built = model_class(config)
    return _with_generation_config(built, folder)


def _with_generation_config(model: nn.Module, folder: str) -> nn.Module:
    """Generation defaults saved next to the weights, as ``from_pretrained`` reads them."""
    if os.path.isfile(os.path.join(folder, "generation_config.json")) and hasattr(model, "generation_config"):
        import transformers

        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model


def load_checkpoint_and_dispatch(
    model: nn.Module | type | transformers.PretrainedConfig,
    checkpoint: str | os.PathLike,
    device_map: DeviceMapArg = "auto",
    max_memory: MaxMemoryArg = None,
    no_split_module_classes: Iterable[str] | None = None,
    offload_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    main_device: int | str | torch.device | None = None,
    print_summary: bool = True,
) -> nn.Module:
    """Build the model on meta (unless given built), load each weight straight to its device, dispatch.

    ``model`` is a module (ideally built in :func:`init_empty_weights`), a model class (its config is
    read from the checkpoint folder) or a config. ``checkpoint`` is a ``save_pretrained`` folder (one
    file or sharded with an index), a ``.safetensors`` file or an index ``.json``. With
    ``device_map="auto"`` disk is always available (weights are read from the checkpoint itself).
    """
    model = build_empty(model, checkpoint)
    refuse_dispatched(model)
    files = checkpoint_files(checkpoint)
    inventory = Inventory(model, dtype)
    device_map, budgets = resolve_device_map(
        model, inventory, device_map, max_memory, no_split_module_classes, offload_dir, True, main_device
    )
    plan = make_plan(inventory, device_map, main_device)
    check_devices_exist(plan)
    reader = SafetensorsFiles()
    disk: dict[str, DiskTensor] = {}
    missing, kept, used = [], [], set()
    keep_fp32 = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for group in inventory.groups:
        key = next((name for name in group.names if name in files), None)
        if key is None:
            if group.tensor.device.type == "meta":
                missing.append(group.name)
                continue
            if group.persistent:
                kept.append(group.name)
            if plan.storage[group.name] != "disk":  # a buffer computed in __init__, or a weight already set
                set_group(group, group.tensor.to(torch_device(plan.storage[group.name])))
            continue
        used.add(key)
        cast = None if keep_fp32 & set(group.name.split(".")) else dtype
        stored = reader.get(files[key], key)  # a view of the mapped file: nothing is read yet
        if stored.shape != group.tensor.shape:
            raise ConfigError(
                f"{key} has shape {tuple(stored.shape)} in the checkpoint but {tuple(group.tensor.shape)} in "
                f"{type(model).__name__}; was the checkpoint saved from a model with this config?"
            )
        if plan.storage[group.name] == "disk":
            disk[group.name] = DiskTensor(reader, files[key], key, cast)
            set_group(group, torch.empty_like(stored, device="meta", dtype=_target_dtype(stored, cast)))
        else:
            tensor = stored.to(torch_device(plan.storage[group.name]), _target_dtype(stored, cast))
            set_group(group, tensor.clone() if tensor is stored else tensor)  # own it, not a view of the file
    if missing:
        raise ConfigError(
            f"the checkpoint {checkpoint} has no values for {len(missing)} tensors of {type(model).__name__} "
            f"(e.g. {', '.join(missing[:3])}); was it saved from this model class?"
        )
    if kept:
        logger.warning(
            "%d tensors are not in the checkpoint and keep their current values (e.g. %s)", len(kept), kept[0]
        )
    unused = set(files) - used
    if unused:
        logger.warning("%d tensors of the checkpoint are not used by the model (e.g. %s)", len(unused), min(unused))
    folder = None
    if disk and offload_dir is not None:
        folder = rank_folder(os.fspath(offload_dir))
        for entry, groups in by_entry([g for g in inventory.groups if g.name in disk], plan).items():
            written = write_offload(
                folder, entry, {g.name: disk[g.name].load(torch.device("cpu")) for g in groups}, reader
            )
            disk.update(written)
        write_index(folder, disk)
    elif disk:
        folder = f"{os.fspath(checkpoint)} (read in place)"
    model.eval()
    finish_dispatch(model, inventory, plan, disk, budgets, folder, print_summary)
    return model


def _target_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
