"""What this machine has: accelerate.utils' ``is_*_available`` checks, with their names and answers.

Scripts written for accelerate pick a device's memory API or an optional package with these
(``if is_xpu_available(): torch.xpu.max_memory_allocated()``, ``if not is_schedulefree_available(): raise``).
A package counts as installed when it is importable and has distribution metadata (a stray folder of that name
does not count); a device backend's plug-in (``torch_npu``, ``torch_mlu`` …) is imported only when it is
installed, as accelerate does. Answers are ``True``/``False`` (accelerate returns ``None`` for some packages that
are absent). Nothing here imports torch or package metadata until a check asks for them: ``trainer_ext`` reads
``__all__`` from this module when it is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import operator
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_aim_available",
    "is_bf16_available",
    "is_bnb_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_fp16_available",
    "is_hpu_available",
    "is_matplotlib_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mps_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_pandas_available",
    "is_peft_available",
    "is_rocm_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_trackio_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
    "is_weights_only_available",
    "is_xpu_available",
]

_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def _installed(module: str, *distributions: str) -> bool:
    """``module`` imports from an installed distribution (its own name, or one of ``distributions``)."""
    import importlib.metadata  # here, not at the top: ``import trainer_ext`` reads this module's names

    if importlib.util.find_spec(module) is None:
        return False
    for name in distributions or (module,):
        try:
            importlib.metadata.metadata(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def _version_holds(distribution: str, operation: str, required: str) -> bool:
    import importlib.metadata

    from packaging.version import parse

    if operation not in _COMPARE:
        raise ValueError(f"operation must be one of {', '.join(_COMPARE)}; got {operation!r}")
    return _COMPARE[operation](parse(importlib.metadata.version(distribution)), parse(required))


def is_torch_version(operation: str, version: str) -> bool:
    """Whether the installed torch compares to ``version`` by ``operation`` (``">="``, ``"<"`` …)."""
    return _version_holds("torch", operation, version)


def _package(module: str, name: str = "", *, at_least: str | None = None, below: str | None = None) -> Callable:
    """``is_<name>_available()`` for an optional package (in the version range accelerate asks for, if any)."""

    def check() -> bool:
        if not _installed(module):
            return False
        if at_least is not None and not _version_holds(module, ">=", at_least):
            return False
        return below is None or _version_holds(module, "<", below)

    check.__name__ = check.__qualname__ = f"is_{name or module}_available"
    versions = ", ".join(v for v in (at_least and f">= {at_least}", below and f"< {below}") if v)
    check.__doc__ = f"{module} is installed{f' ({versions})' if versions else ''}."
    return check


is_schedulefree_available = _package("schedulefree")
is_deepspeed_available = _package("deepspeed")
is_peft_available = _package("peft")
is_transformers_available = _package("transformers")
is_datasets_available = _package("datasets")
is_timm_available = _package("timm")
is_torchvision_available = _package("torchvision")
is_torchdata_available = _package("torchdata")
is_torchdata_stateful_dataloader_available = _package("torchdata", "torchdata_stateful_dataloader", at_least="0.8.0")
is_torchao_available = _package("torchao", at_least="0.6.1")
is_4bit_bnb_available = _package("bitsandbytes", "4bit_bnb", at_least="0.39.0")
is_8bit_bnb_available = _package("bitsandbytes", "8bit_bnb", at_least="0.37.2")
is_pandas_available = _package("pandas")
is_matplotlib_available = _package("matplotlib")
is_wandb_available = _package("wandb")
is_comet_ml_available = _package("comet_ml")
is_clearml_available = _package("clearml")
is_dvclive_available = _package("dvclive")
is_swanlab_available = _package("swanlab")
is_aim_available = _package("aim", below="4.0.0")


def is_bnb_available(min_version: str | None = None) -> bool:
    """bitsandbytes is installed (at ``min_version`` or later when given)."""
    return _package("bitsandbytes", "bnb", at_least=min_version)()


def is_tensorboard_available() -> bool:
    """tensorboard or tensorboardX is installed."""
    return _installed("tensorboard") or _installed("tensorboardX")


def is_mlflow_available() -> bool:
    """mlflow (or its ``mlflow-skinny`` distribution) is installed."""
    return _installed("mlflow", "mlflow", "mlflow-skinny")


def is_trackio_available() -> bool:
    """trackio is installed (it needs Python 3.10 or later)."""
    return sys.version_info >= (3, 10) and _installed("trackio")


def is_triton_available() -> bool:
    """triton is installed (its ``triton-xpu`` build where an XPU is present)."""
    return _installed("triton", "triton-xpu") if is_xpu_available() else _installed("triton")


def is_weights_only_available() -> bool:
    """``torch.load(weights_only=True)`` with an allow-list of globals (torch 2.4 or later)."""
    return is_torch_version(">=", "2.4.0")


# -- devices ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def is_cuda_available() -> bool:
    """A CUDA GPU is visible, asked through NVML so that CUDA itself stays uninitialised (fork-safe)."""
    import torch

    with _env("PYTORCH_NVML_BASED_CUDA_CHECK", "1"):
        return torch.cuda.is_available()


def is_rocm_available() -> bool:
    """torch is a ROCm build and sees a GPU."""
    import torch

    return torch.version.hip is not None and torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Apple's MPS backend is built into torch (``min_version`` or later) and usable here."""
    import torch

    backend = torch.backends.mps
    return is_torch_version(">=", min_version) and backend.is_available() and backend.is_built()


def _plugin_device(plugin: str, attribute: str, check_device: bool) -> bool:
    """A device that a torch plug-in package adds as ``torch.<attribute>``: installed, imported, present."""
    if importlib.util.find_spec(plugin) is None:
        return False
    try:
        importlib.import_module(plugin)
    except Exception:  # a plug-in built for hardware this machine lacks may fail to import at all
        return False
    import torch

    backend = getattr(torch, attribute, None)
    if backend is None:
        return False
    if check_device:
        try:
            backend.device_count()  # raises where the driver finds no device
        except RuntimeError:
            return False
    return bool(backend.is_available())


@functools.lru_cache
def is_npu_available(check_device: bool = False) -> bool:
    """An Ascend NPU through ``torch_npu``."""
    return _plugin_device("torch_npu", "npu", check_device)


@functools.lru_cache
def is_mlu_available(check_device: bool = False) -> bool:
    """A Cambricon MLU through ``torch_mlu`` (asked through its driver library, leaving the device uninitialised)."""
    with _env("PYTORCH_CNDEV_BASED_MLU_CHECK", "1"):
        return _plugin_device("torch_mlu", "mlu", False)


@functools.lru_cache
def is_musa_available(check_device: bool = False) -> bool:
    """A Moore Threads GPU through ``torch_musa``."""
    return _plugin_device("torch_musa", "musa", check_device)


@functools.lru_cache
def is_sdaa_available(check_device: bool = False) -> bool:
    """A Tecorigin SDAA through ``torch_sdaa``."""
    return _plugin_device("torch_sdaa", "sdaa", check_device)


@functools.lru_cache
def is_neuron_available(check_device: bool = False) -> bool:
    """An AWS Neuron device through ``torch_neuronx``."""
    return _plugin_device("torch_neuronx", "neuron", check_device)


@functools.lru_cache
def is_hpu_available(init_hccl: bool = False) -> bool:
    """An Intel Gaudi HPU through ``habana_frameworks.torch`` (``init_hccl``: also load its collectives)."""
    if importlib.util.find_spec("habana_frameworks") is None or not _installed_submodule("habana_frameworks.torch"):
        return False
    if init_hccl:
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
    return _plugin_device("habana_frameworks.torch", "hpu", False)


def _installed_submodule(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@functools.lru_cache
def is_xpu_available(check_device: bool = False) -> bool:
    """An Intel GPU through torch's own XPU backend (torch 2.7 or later)."""
    import torch

    if not is_torch_version(">", "2.6"):
        return False
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return False
    if check_device:
        try:
            xpu.device_count()
        except RuntimeError:
            return False
    return bool(xpu.is_available())


@functools.lru_cache
def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """torch_xla is installed and imports (unless ``USE_TORCH_XLA`` turns it off); optionally on a TPU / a GPU."""
    if check_is_tpu and check_is_gpu:
        raise ValueError("check_is_tpu and check_is_gpu cannot both be true")
    if os.environ.get("USE_TORCH_XLA", "1").strip().lower() in ("0", "false", "no", "off", "n", "f"):
        return False
    if importlib.util.find_spec("torch_xla") is None:
        return False
    try:
        importlib.import_module("torch_xla.core.xla_model")
        runtime = importlib.import_module("torch_xla.runtime")
    except ImportError:
        return False
    if check_is_gpu:
        return runtime.device_type() in ("GPU", "CUDA")
    if check_is_tpu:
        return runtime.device_type() == "TPU"
    return True


# -- precision ----------------------------------------------------------------------------------------------------
def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """The accelerator in use computes in bfloat16 (always on CPU; on a TPU unless ``ignore_tpu``)."""
    import torch

    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    if is_mlu_available():
        return torch.mlu.is_bf16_supported()
    if is_xpu_available():
        return torch.xpu.is_bf16_supported()
    if is_mps_available():
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True


def is_fp16_available() -> bool:
    """float16 computes here (everywhere but a first-generation Gaudi)."""
    if not is_hpu_available():
        return True
    experimental = importlib.import_module("habana_frameworks.torch.utils.experimental")
    return experimental._get_device_type() != experimental.synDeviceType.synDeviceGaudi
