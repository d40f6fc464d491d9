"""accelerate's configuration objects for hand-written loops, under the same names, fields, defaults and meaning.

``from accelerate.utils import GradScalerKwargs`` becomes ``from trainer_ext import GradScalerKwargs``. Bad values
fail at construction with a ConfigError that says how to fix them. torch loads lazily, only where it is used.
"""

from __future__ import annotations

import copy
import enum
import inspect
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from trainer_ext.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    import torch


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_flags(obj: Any, *names: str) -> None:
    """A flag given as a string ('false' is truthy) or as a number other than 0/1 is a mistake, not a choice."""
    for name in names:
        value = getattr(obj, name)
        ok = not isinstance(value, str) and value in (True, False)
        _require(ok, f"{type(obj).__name__}.{name} must be True or False, got {value!r}.")


def _check_int(obj: Any, name: str, minimum: int, optional: bool = False) -> None:
    value = getattr(obj, name)
    integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    ok = (value is None and optional) or (integer and value >= minimum)
    allowed = f"an integer >= {minimum}" + (" or None" if optional else "")
    _require(ok, f"{type(obj).__name__}.{name} must be {allowed}, got {value!r}.")


class KwargsHandler:
    """Base of the ``kwargs_handlers`` objects: ``to_kwargs()`` gives the fields set away from their defaults."""

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict[str, Any]:
        """Only the values that differ from a default-constructed instance: what gets forwarded to torch."""
        defaults = type(self)().to_dict()
        return {key: value for key, value in self.to_dict().items() if defaults[key] != value}


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for the ``torch.autocast`` around the prepared model's forward under mixed precision."""

    enabled: bool = True
    cache_enabled: bool | None = None


class _ContainsValue(enum.EnumMeta):
    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class DDPCommunicationHookType(enum.Enum, metaclass=_ContainsValue):
    """A DDP gradient communication hook; ``str()`` gives its value and ``"fp16" in DDPCommunicationHookType`` works."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [member.value for member in cls]


_HOOK_ALIASES = {"powersgd": "power_sgd", "batched_powersgd": "batched_power_sgd", "none": "no"}
_POWER_SGD = (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
_WRAPPERS = (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16, DDPCommunicationHookType.BF16)


def _hook_type(value: DDPCommunicationHookType | str, what: str) -> DDPCommunicationHookType:
    if isinstance(value, DDPCommunicationHookType):
        return value
    name = _HOOK_ALIASES.get(str(value).lower(), str(value).lower())
    valid = DDPCommunicationHookType.list()
    message = f"{what}={value!r} is not a DDP communication hook; use one of {valid}." + did_you_mean(name, valid)
    _require(name in DDPCommunicationHookType, message)
    return DDPCommunicationHookType(name)


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for ``DistributedDataParallel`` when ``prepare`` wraps a model in DDP, plus an optional comm hook.

    ``to_kwargs()`` leaves out the three ``comm_*`` fields: they go to ``register_comm_hook``, not to DDP.
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = _hook_type(self.comm_hook, "comm_hook")
        self.comm_wrapper = _hook_type(self.comm_wrapper, "comm_wrapper")
        message = f"comm_wrapper={str(self.comm_wrapper)!r} is not a wrapper; use 'no', 'fp16' or 'bf16'."
        _require(self.comm_wrapper in _WRAPPERS, message)
        if self.comm_state_option and self.comm_hook in _POWER_SGD:
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

            valid = [p for p in inspect.signature(PowerSGDState).parameters if p != "process_group"]
            unknown = sorted(set(self.comm_state_option) - set(valid))
            _require(not unknown, f"comm_state_option has keys PowerSGDState does not take: {unknown}; use {valid}.")

    def to_dict(self, ignore_keys: tuple[str, ...] = ("comm_hook", "comm_wrapper", "comm_state_option")) -> dict:
        return {key: value for key, value in super().to_dict().items() if key not in ignore_keys}

    def register_comm_hook(self, model: Any) -> None:
        """Install the hook (wrapped by ``comm_wrapper``) on a DDP-wrapped model; ``comm_hook='no'`` does nothing."""
        if self.comm_hook is DDPCommunicationHookType.NO:
            return
        _require(
            hasattr(model, "register_comm_hook"),
            f"comm_hook={str(self.comm_hook)!r} needs a DistributedDataParallel model, got {type(model).__name__}; "
            "communication hooks apply only where the model is wrapped in DDP.",
        )
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks: dict[DDPCommunicationHookType, Callable] = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
            DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
            DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
        }
        wrappers = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
        }
        hook = hooks[self.comm_hook]
        if self.comm_wrapper in wrappers:
            hook = wrappers[self.comm_wrapper](hook)
        state = powerSGD_hook.PowerSGDState(None, **self.comm_state_option) if self.comm_hook in _POWER_SGD else None
        model.register_comm_hook(state=state, hook=hook)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for the ``torch.amp.GradScaler`` that fp16 mixed precision creates."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            value = getattr(self, name)
            _require(isinstance(value, numbers.Real), f"GradScalerKwargs.{name} must be a number, got {value!r}.")
        _require(self.init_scale > 0, f"GradScalerKwargs.init_scale must be > 0, got {self.init_scale!r}.")
        _require(self.growth_factor > 1, f"GradScalerKwargs.growth_factor must be > 1, got {self.growth_factor!r}.")
        backoff = self.backoff_factor
        _require(0 < backoff < 1, f"GradScalerKwargs.backoff_factor must be between 0 and 1, got {backoff!r}.")
        _check_int(self, "growth_interval", 1)


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for ``torch.distributed.init_process_group``; no ``timeout`` means 10 min for nccl, else 30."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.timeout is None:
            self.timeout = timedelta(seconds=600 if self.backend == "nccl" else 1800)
        elif type(self.timeout) in (int, float):
            self.timeout = timedelta(seconds=self.timeout)
        ok = isinstance(self.timeout, timedelta) and self.timeout > timedelta(0)
        fix = "e.g. timeout=timedelta(minutes=30)"
        _require(ok, f"InitProcessGroupKwargs.timeout must be a positive timedelta ({fix}), got {self.timeout!r}.")


_ACTIVITIES = ("cpu", "cuda", "xpu", "mtia", "hpu")


@dataclass
class ProfileKwargs(KwargsHandler):
    """Settings of the ``torch.profiler.profile`` that ``Accelerator.profile()`` runs.

    ``build()`` does not read ``output_trace_dir``; ``export_trace`` writes there once profiling has ended.
    """

    activities: list[str] | None = None  # 'cpu', 'cuda', 'xpu', 'mtia', 'hpu'
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def __post_init__(self) -> None:
        valid = list(_ACTIVITIES)
        for activity in self.activities or []:
            name = str(activity).lower()
            hint = did_you_mean(name, valid)
            _require(name in valid, f"Invalid profiler activity: {activity!r}. Must be one of {valid}.{hint}")
        if self.schedule_option is not None:
            import torch.profiler

            params = inspect.signature(torch.profiler.schedule).parameters
            unknown = sorted(set(self.schedule_option) - set(params))
            missing = [n for n, p in params.items() if p.default is p.empty and n not in self.schedule_option]
            _require(
                not unknown and not missing,
                f"ProfileKwargs.schedule_option: unknown keys {unknown}, missing keys {missing}; "
                f"torch.profiler.schedule takes {list(params)}, e.g. dict(wait=1, warmup=1, active=3).",
            )

    @staticmethod
    def _activity(activity: str) -> torch.profiler.ProfilerActivity:
        import torch

        name = activity.lower()
        if name in ("xpu", "mtia", "hpu"):
            backend = getattr(torch, name, None)
            available = backend is not None and backend.is_available()
            _require(available, f"Profiler activity {activity!r} needs a {name.upper()} device; none is available.")
        return getattr(torch.profiler.ProfilerActivity, name.upper())

    def build(self) -> torch.profiler.profile:
        """A ``torch.profiler.profile`` with these activities, schedule and recording options, not yet started."""
        import torch.profiler

        activities = None if self.activities is None else [self._activity(a) for a in self.activities]
        schedule = None if self.schedule_option is None else torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )

    def export_trace(self, profiler: torch.profiler.profile, process_index: int = 0) -> str | None:
        """Write a finished profile to ``output_trace_dir/profile_{process_index}.json`` (Chrome trace); None: no dir."""
        if self.output_trace_dir is None:
            return None
        os.makedirs(self.output_trace_dir, exist_ok=True)
        path = os.path.join(self.output_trace_dir, f"profile_{process_index}.json")
        profiler.export_chrome_trace(path)
        return path


@dataclass
class ProjectConfiguration:
    """Where ``save_state`` and trackers write: directories, automatic checkpoint naming and how many to keep."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | None = None) -> None:
        """Set ``project_dir``; ``logging_dir`` follows it unless it was given."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)
        _check_int(self, "total_limit", 1, optional=True)
        _check_int(self, "iteration", 0)
        _check_flags(self, "automatic_checkpoint_naming", "save_on_each_node")


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards and feeds dataloaders: batch splitting, dispatching, padding, seeding, transfers."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        flags = ["split_batches", "even_batches", "use_seedable_sampler", "non_blocking", "use_stateful_dataloader"]
        _check_flags(self, *flags, *(["dispatch_batches"] if self.dispatch_batches is not None else []))
        _check_int(self, "data_seed", -(2**63), optional=True)


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation for ``Accelerator.accumulate``: micro-steps per update and when gradients sync."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        _check_int(self, "num_steps", 1, optional=True)
        _check_flags(self, "adjust_scheduler", "sync_with_dataloader", "sync_each_batch")


def split_handlers(kwargs_handlers: list[KwargsHandler] | None) -> dict[type, KwargsHandler]:
    """Group ``Accelerator(kwargs_handlers=[...])`` by class: handler objects only, at most one of each class."""
    found: dict[type, KwargsHandler] = {}
    for handler in kwargs_handlers or []:
        cls = type(handler)
        from_accelerate = cls.__module__.split(".")[0] == "accelerate"
        hint = f" Import {cls.__name__} from trainer_ext instead of accelerate." if from_accelerate else ""
        _require(
            isinstance(handler, KwargsHandler),
            f"Unsupported kwargs handler passed: {handler!r}, must be one that inherits `trainer_ext.KwargsHandler`.{hint}",
        )
        _require(
            cls not in found,
            f"You can only pass one {cls} in `kwargs_handlers`. Merge their settings into a single {cls.__name__}.",
        )
        found[cls] = handler
    return found
