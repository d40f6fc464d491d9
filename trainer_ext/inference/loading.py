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
import stat
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from trainer_ext.errors import ConfigError
from trainer_ext.inference.devices import torch_device
from trainer_ext.inference.dispatch import (
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
from trainer_ext.inference.inventory import Inventory
from trainer_ext.inference.offload import DiskTensor, SafetensorsFiles, write_index, write_offload
from trainer_ext.inference.plan import make_plan

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 256 << 20  # an index names each tensor once: megabytes even for the largest models


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
        if _kind(os.path.join(path, INDEX_FILE)) != "nothing":
            path = os.path.join(path, INDEX_FILE)
        elif _kind(os.path.join(path, SINGLE_FILE)) != "nothing":
            path = os.path.join(path, SINGLE_FILE)
        else:
            raise ConfigError(
                f"{checkpoint} holds neither {SINGLE_FILE} nor {INDEX_FILE}; pass a folder written by "
                "save_pretrained (safetensors), a .safetensors file or its index .json"
            )
    kind = _kind(path)
    if kind == "nothing":
        raise ConfigError(f"checkpoint {checkpoint} does not exist")
    if kind != "a regular file":
        raise ConfigError(f"checkpoint {path} is {kind}, not a file; pass a save_pretrained folder or its files")
    if path.endswith(".json"):
        return _index_files(path)
    if not path.endswith(".safetensors"):
        raise ConfigError(f"{checkpoint}: only safetensors checkpoints are supported (save_pretrained writes them)")
    return dict.fromkeys(SafetensorsFiles().keys(path), path)


def _index_files(path: str) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index: every file it names a ``.safetensors`` file in its own folder."""
    with open(path, "rb") as f:
        text = f.read(MAX_INDEX_BYTES + 1)
    if len(text) > MAX_INDEX_BYTES:
        raise ConfigError(f"{path} is over {MAX_INDEX_BYTES >> 20} MiB; a safetensors index is a small JSON file")
    try:
        index = json.loads(text)
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested past Python's stack
        said = " ".join(str(error).split())[:200] or "nested too deep"
        raise ConfigError(f"{path} is not a safetensors index (invalid JSON: {said})") from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ConfigError(f"{path} has no 'weight_map'; is it a safetensors index?")
    folder = os.path.dirname(path)
    files = {}
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ConfigError(
                f"{path}: weight_map[{name!r}] must be a file name, got {type(file).__name__}; is it a safetensors "
                "index?"
            )
        parts = file.replace(os.sep, "/").split("/")
        if not file or "\0" in file or os.path.isabs(file) or ".." in parts:
            raise ConfigError(
                f"{path} names {file!r} for {name!r}, outside the checkpoint folder; an index names the files "
                "beside it"
            )
        if not file.endswith(".safetensors"):
            raise ConfigError(
                f"{path} names {file!r} for {name!r}, which is not a .safetensors file (pickled weights are never "
                "loaded); save the model with save_pretrained (safetensors)"
            )
        files[name] = os.path.join(folder, file)
    for file in sorted(set(files.values())):
        kind = _kind(file).replace("nothing", "missing")
        if kind != "a regular file":
            raise ConfigError(
                f"{path} names {os.path.basename(file)}, but {file} is {kind}; the checkpoint is not whole"
            )
    return files


def _kind(path: str) -> str:
    """What is at ``path``, in words: 'a regular file' (also through a link), 'a folder', 'a FIFO', 'nothing' …"""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return "nothing"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "a device or socket"


def build_empty(model: nn.Module | type | transformers.PretrainedConfig, checkpoint: str | os.PathLike) -> nn.Module:
    """The model with its parameters on meta: as given, from a model class, or from a config."""
    if isinstance(model, nn.Module):
        return model
    import transformers  # only here: importing trainer_ext.inference stays light

    folder = os.fspath(checkpoint)
    folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
    if isinstance(model, type) and hasattr(model, "from_config") and not issubclass(model, nn.Module):
        config = _read_config(transformers.AutoConfig, folder)  # an Auto class: AutoModelForCausalLM …
        with init_empty_weights():
            built = model.from_config(config)
        return _with_generation_config(built, folder)
    if isinstance(model, type) and issubclass(model, nn.Module):
        if not hasattr(model, "config_class"):
            raise ConfigError(f"cannot build {model.__name__} from a checkpoint: pass an instance instead")
        config = _read_config(model.config_class, folder)
        model_class = model
    elif isinstance(model, transformers.PretrainedConfig):
        config = model
        architectures = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        if model_class is None:
            raise ConfigError(
                f"the config names no known model class (architectures={architectures}); pass the class or an "
                "instance built inside trainer_ext.inference.init_empty_weights()"
            )
    else:
        raise ConfigError(f"model must be a module, a model class or a config, not {type(model).__name__}")
    with init_empty_weights():
        built = model_class(config)
    return _with_generation_config(built, folder)


def _read_config(config_class: type, folder: str) -> Any:
    """The model config saved in ``folder``; ConfigError when it is missing or not a config."""
    try:
        return config_class.from_pretrained(folder)
    except Exception as error:  # the file's fault whatever the type (OSError, JSON, a strict field's validation)
        said = " ".join(str(error).split())[:300] or type(error).__name__
        raise ConfigError(f"could not read the model config in {folder}: {said}") from error


def _with_generation_config(model: nn.Module, folder: str) -> nn.Module:
    """Generation defaults saved next to the weights, as ``from_pretrained`` reads them."""
    if os.path.isfile(os.path.join(folder, "generation_config.json")) and hasattr(model, "generation_config"):
        import transformers

        model.generation_config = _read_config(transformers.GenerationConfig, folder)
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
