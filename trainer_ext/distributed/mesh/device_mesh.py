"""The ``DeviceMesh`` of a ``ParallelismConfig``: accelerate's dimension order, its flattened ``dp``,
``dp_shard_cp`` and ``dp_cp`` views, and the check that the sizes multiply to the world size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainer_ext.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from trainer_ext.distributed.mesh.config import ParallelismConfig

# flattened view -> the config property naming the dimensions it joins (accelerate's three)
FLATTENED = (("dp", "dp_dim_names"), ("dp_shard_cp", "dp_shard_cp_dim_names"), ("dp_cp", "dp_cp_dim_names"))


def check_world_size(config: ParallelismConfig, world_size: int) -> None:
    """Refuse sizes that do not multiply to ``world_size``, in one line naming each factor."""
    if config.total_size != world_size:
        sizes = {name: size for name, size in config._sizes.items() if name != "pp" or size > 1}  # pp: ours
        factors = " × ".join(f"{name} {size}" for name, size in sizes.items())
        raise ConfigError(
            f"ParallelismConfig spans {_processes(config.total_size)} ({factors}) but the job has {world_size}: "
            f"make the sizes multiply to {world_size}, or launch {_processes(config.total_size)}"
        )


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


def fit_to_world(config: ParallelismConfig, world_size: int) -> None:
    """accelerate's rule: a configuration of size 1 on several processes replicates over all of them (plain data
    parallelism); ours: ``pp_size`` alone on a multiple of it shards each stage over the rest (FSDP2); any other is
    checked against ``world_size``."""
    if config.total_size == 1 and world_size > 1:
        config._set_size("dp_replicate", world_size)
    elif config.total_size == config.pp_size > 1 and world_size > config.pp_size and world_size % config.pp_size == 0:
        config._set_size("dp_shard", world_size // config.pp_size)  # ours: stages sharded over the rest
    check_world_size(config, world_size)


@dataclass(frozen=True)
class ParallelMesh:
    """The N-D mesh and a 1-D mesh per name: its own dimensions and the flattened views (``views["dp"]``)."""

    mesh: DeviceMesh
    views: dict[str, DeviceMesh] = field(default_factory=dict)

    def __getitem__(self, name: str) -> DeviceMesh:
        """The 1-D mesh of dimension or view ``name`` (no slicing of the root, so no deprecation warning)."""
        try:
            return self.views[name]
        except KeyError:
            raise KeyError(f"no mesh dimension {name!r}: this mesh has {', '.join(self.views)}") from None


def build_parallel_mesh(
    config: ParallelismConfig, device_type: str, world_size: int | None = None
) -> ParallelMesh | None:
    """``init_device_mesh`` over the enabled dimensions in accelerate's order, with the flattened views; None when no
    dimension is enabled. ``world_size`` defaults to the process group's (1 without one)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    check_world_size(config, world_size)
    dims = config._get_mesh()
    if not dims:
        return None
    names, shape = dims
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    views = {name: mesh[name] for name in names}
    for view, joined in FLATTENED:
        dim_names = getattr(config, joined)
        if dim_names:
            views[view] = mesh[tuple(dim_names)]._flatten(view)
    return ParallelMesh(mesh, views)


def build_device_mesh(config: ParallelismConfig, device_type: str, world_size: int | None = None) -> DeviceMesh | None:
    """The root ``DeviceMesh`` alone (what accelerate's ``build_device_mesh`` returns), or None."""
    built = build_parallel_mesh(config, device_type, world_size)
    return None if built is None else built.mesh
