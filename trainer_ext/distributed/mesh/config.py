"""accelerate's ``ParallelismConfig``: the sizes of the data-replicate, data-shard, context, sequence and tensor
parallel dimensions, with accelerate's field names, defaults, properties and ``PARALLELISM_CONFIG_*`` variables.

Our differences, on purpose: it is valid on CPU/gloo as on GPUs; bad input is one ``ConfigError`` line; ``cp_backend``
chooses among ``auto`` (default), ``torch`` and ``all_gather``; ``pp_size``, ``pp_schedule`` and ``pp_microbatches``
(pipeline parallelism) are ours; sequence parallelism (``sp_size`` > 1) is refused until it
is implemented; ``to_json`` returns the
fields (accelerate's returns None); the dimension sizes are read from the fields, so a size set after construction
(as transformers' Trainer does) is the size every property and the mesh see. Imports no torch.
"""

from __future__ import annotations

import operator
import os
import warnings
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

from trainer_ext.errors import ConfigError

ENV_PREFIX = "PARALLELISM_CONFIG_"
# accelerate's order of the mesh's dimensions, outermost first, with ours (pp) inside the data-parallel ones: the
# ranks that read one batch (pp × cp × tp) are neighbours
MESH_ORDER = ("dp_replicate", "dp_shard", "pp", "cp", "sp", "tp")
SIZE_NAMES = ("dp_replicate", "dp_shard", "tp", "cp", "sp", "pp")
CP_BACKENDS = ("auto", "torch", "all_gather")  # ours: auto picks torch on CUDA, all_gather elsewhere
SP_BACKENDS = ("deepspeed",)
# ours: the pipeline schedules of torch.distributed.pipelining, by the name users pick them with
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")


@dataclass
class TorchTensorParallelConfig:
    """accelerate's tensor-parallel handler; ``enable_async_tp`` is accepted and ignored with a warning, as there.
    ``tp_plan`` (ours) replaces the model's own plan: {module name, ``*`` for a layer number: style name}."""

    enable_async_tp: bool = False
    tp_plan: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            warnings.warn(
                "Asynchronous tensor parallelism is not supported; enable_async_tp is ignored.", stacklevel=2
            )


def _env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _size(field_name: str, value: Any) -> int:
    """``value`` as a size (a whole number ≥ 1), or the ``PARALLELISM_CONFIG_*`` variable's when it is None."""
    if value is None:
        variable = _env_name(field_name)
        text = os.environ.get(variable, "1").strip()
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(
                f"{variable}={text!r} is not a whole number: set it to a size such as 2, or unset it"
            ) from None
        where = f"{variable}={text}"
    else:
        if isinstance(value, bool):
            raise ConfigError(f"ParallelismConfig {field_name}={value!r} is not a size: pass a whole number ≥ 1")
        try:
            value = operator.index(value)
        except TypeError:
            raise ConfigError(
                f"ParallelismConfig {field_name}={value!r} is not a size: pass a whole number ≥ 1"
            ) from None
        where = f"{field_name}={value}"
    if value < 1:
        raise ConfigError(f"ParallelismConfig {field_name} must be at least 1, got {where}: use 1 to leave it off")
    return value


def _split(value: Any) -> list[int] | None:
    """``pp_split`` (ours): the first decoder layer of each stage after the first, as a list of whole numbers, from
    ``value`` or ``PARALLELISM_CONFIG_PP_SPLIT`` ("4,8"); None leaves the stages balanced by parameter count."""
    where = "pp_split"
    if value is None:
        text = os.environ.get(_env_name("pp_split"), "").strip()
        if not text:
            return None
        where = f"{_env_name('pp_split')}={text}"
        value = text.split(",")
    try:
        cuts = [operator.index(int(v)) if isinstance(v, str) else operator.index(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(
            f"ParallelismConfig {where} is not a list of layer indices: give the first layer of each stage after the "
            "first, e.g. [4] or '4,8'"
        ) from None
    if not cuts or cuts != sorted(set(cuts)) or cuts[0] < 1:
        raise ConfigError(
            f"ParallelismConfig {where}: the layer indices must be increasing and at least 1, got {cuts}"
        )
    return cuts


def _backend(field_name: str, value: Any, valid: tuple[str, ...]) -> str:
    """``value`` (or its ``PARALLELISM_CONFIG_*`` variable's, default the first valid one), checked against ``valid``."""
    if value is None:
        value = os.environ.get(_env_name(field_name), valid[0])
    if value not in valid:
        choices = " or ".join(repr(choice) for choice in valid)
        raise ConfigError(f"ParallelismConfig {field_name}={value!r} is unknown: choose {choices}")
    return value


@dataclass
class ParallelismConfig:
    """How many ranks each parallel dimension spans; ``total_size`` is the number of processes.

    ``dp_shard_size > 1`` alone is FSDP; with ``dp_replicate_size > 1`` too it is HSDP; ``tp_size`` splits each layer
    across ranks that see the same batch. A size left None is read from ``PARALLELISM_CONFIG_<FIELD>`` (default 1).
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    pp_size: int | None = None
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    pp_split: list[int] | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None

    device_mesh = None  # the mesh built by get_device_mesh (a class attribute, as accelerate's: not a field)

    def __post_init__(self) -> None:
        for name in SIZE_NAMES:
            setattr(self, f"{name}_size", _size(f"{name}_size", getattr(self, f"{name}_size")))
        self.cp_backend = _backend("cp_backend", self.cp_backend, CP_BACKENDS)
        self.sp_backend = _backend("sp_backend", self.sp_backend, SP_BACKENDS)
        self.pp_schedule = _backend("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        if self.pp_microbatches is not None or os.environ.get(_env_name("pp_microbatches")):
            self.pp_microbatches = _size("pp_microbatches", self.pp_microbatches)
        self.pp_split = _split(self.pp_split)
        if self.cp_size > 1 and self.sp_size > 1:
            raise ConfigError(
                f"ParallelismConfig cp_size={self.cp_size} and sp_size={self.sp_size}: context and sequence "
                "parallelism exclude each other; set one of them to 1"
            )
        if (self.tp_size > 1 or self.cp_size > 1) and self.dp_replicate_size > 1 and self.dp_shard_size == 1:
            raise ConfigError(
                f"ParallelismConfig dp_replicate_size={self.dp_replicate_size} with dp_shard_size=1 and "
                f"tp_size={self.tp_size}, cp_size={self.cp_size}: tensor/context parallelism does not compose with "
                "pure replication; shard instead (dp_shard_size > 1, with dp_replicate_size > 1 for HSDP)"
            )
        if self.sp_size > 1:
            raise ConfigError(
                f"ParallelismConfig sp_size={self.sp_size}: sequence (Ulysses) parallelism is not supported yet; "
                "set sp_size=1 and use cp_size to split long sequences"
            )
        if self.pp_size > 1 and self.dp_replicate_size > 1 and self.dp_shard_size == 1:
            raise ConfigError(
                f"ParallelismConfig pp_size={self.pp_size} with dp_replicate_size={self.dp_replicate_size} alone: "
                "pipeline stages are data-parallel through FSDP2; set dp_shard_size instead (with dp_replicate_size "
                "> 1 too for HSDP)"
            )
        if self.pp_size > 1 and self.cp_size > 1:
            raise ConfigError(
                f"ParallelismConfig pp_size={self.pp_size} with cp_size={self.cp_size}: pipeline parallelism does not "
                "compose with context parallelism yet; set cp_size=1"
            )
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()

    # sizes and names, as accelerate's properties ------------------------------------------------------------------

    @property
    def _sizes(self) -> dict[str, int]:
        """Dimension name -> size, read from the fields (never a stale copy)."""
        return {name: getattr(self, f"{name}_size") for name in SIZE_NAMES}

    def _set_size(self, parallelism: str, size: int) -> None:
        """Set one dimension's size (accelerate's private setter, kept for code that calls it)."""
        if parallelism not in SIZE_NAMES:
            raise ConfigError(f"unknown parallel dimension {parallelism!r}: one of {', '.join(SIZE_NAMES)}")
        setattr(self, f"{parallelism}_size", _size(f"{parallelism}_size", size))

    @property
    def total_size(self) -> int:
        """The number of processes the configuration spans: the product of every size."""
        return self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size * self.sp_size * self.pp_size

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that see the same batch: tensor × context × sequence (× pipeline, ours) parallel sizes."""
        return self.tp_size * self.cp_size * self.sp_size * self.pp_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: replicate × shard sizes."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def splits_model(self) -> bool:
        """True when the layout shards the model or its sequences (dp_shard, tp, cp or pp > 1): FSDP2's job, or
        the pipeline's (ours)."""
        return self.dp_shard_size > 1 or self.tp_size > 1 or self.cp_size > 1 or self.pp_size > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        """True when ``dp_replicate_size > 1``."""
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """True when ``dp_shard_size > 1``."""
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        """True when ``tp_size > 1``."""
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        """True when ``cp_size > 1``."""
        return self.cp_size > 1

    @property
    def pp_enabled(self) -> bool:
        """True when ``pp_size > 1`` (ours: pipeline parallelism)."""
        return self.pp_size > 1

    @property
    def sp_enabled(self) -> bool:
        """True when ``sp_size > 1``."""
        return self.sp_size > 1

    def _enabled(self, *names: str) -> list[str]:
        return [name for name in names if self._sizes[name] > 1]

    @property
    def dp_dim_names(self) -> list[str]:
        """The enabled data-parallel dimensions (flattened into the mesh's ``dp``)."""
        return self._enabled("dp_replicate", "dp_shard")

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The enabled dimensions whose ranks see the same batch, in accelerate's order (tp, cp, sp)."""
        return self._enabled("tp", "cp", "sp")

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The enabled dimensions FSDP shards the model over (flattened into ``dp_shard_cp``)."""
        return self._enabled("dp_shard", "cp")

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """The enabled dimensions the loss is averaged over (flattened into ``dp_cp``)."""
        return self._enabled("dp_replicate", "dp_shard", "cp")

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh dimensions FSDP is applied on: ``dp_replicate`` when enabled (HSDP), then ``dp_shard_cp``."""
        return [*self._enabled("dp_replicate"), "dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """Every enabled dimension: the data-parallel ones, then the others (the pipeline's first, ours)."""
        return self.dp_dim_names + self._enabled("pp") + self.non_dp_dim_names

    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]] | tuple[()]:
        """(dimension names, sizes) of the mesh in ``MESH_ORDER``, enabled dimensions only; () when none is."""
        active = set(self.active_mesh_dims)
        names = tuple(name for name in MESH_ORDER if name in active)
        return (names, tuple(self._sizes[name] for name in names)) if names else ()

    # the mesh ----------------------------------------------------------------------------------------------------

    def build_device_mesh(self, device_type: str) -> Any:
        """The ``DeviceMesh`` over the current process group (None when no dimension is enabled)."""
        from trainer_ext.distributed.mesh.device_mesh import build_parallel_mesh

        built = build_parallel_mesh(self, device_type)
        return None if built is None else built.mesh

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """The mesh, built on first call for ``device_type``; a later call with another device type is refused."""
        if self.device_mesh is None:
            if device_type is None:
                raise ConfigError("ParallelismConfig.get_device_mesh: pass device_type (e.g. 'cpu' or 'cuda')")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ConfigError(
                f"ParallelismConfig's mesh was built for {self.device_mesh.device_type!r}, not {device_type!r}: "
                "use one device type per process"
            )
        return self.device_mesh

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the built mesh (it holds this process's groups; training_args.bin carries the config)."""
        state = dict(self.__dict__)
        state.pop("device_mesh", None)
        return state

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON-ready values (handlers as dicts); the mesh is left out."""
        out: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if is_dataclass(value) and not isinstance(value, type):
                value = asdict(value)
            elif hasattr(value, "__dict__") and not isinstance(value, type):
                value = dict(vars(value))
            out[item.name] = value
        return out
