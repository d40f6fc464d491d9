"""The N-D layouts composed on a built mesh: tensor parallelism over ``tp``, then FSDP2 over ``dp_shard_cp`` (HSDP
over ``(dp_replicate, dp_shard_cp)`` when replication is enabled too), decoder layers first and the root last.

Pure replication (``dp_replicate`` alone) is left to DDP, as accelerate does: nothing here shards it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer_ext.distributed.mesh.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from trainer_ext.distributed.mesh.config import ParallelismConfig
    from trainer_ext.distributed.mesh.device_mesh import ParallelMesh


def fsdp_mesh(built: ParallelMesh, config: ParallelismConfig) -> DeviceMesh | None:
    """The mesh ``fully_shard`` takes: 1-D ``dp_shard_cp``, or 2-D (``dp_replicate``, ``dp_shard_cp``) for HSDP;
    None when no dimension shards (replication alone, or tensor parallelism alone)."""
    if not config.dp_shard_cp_dim_names:
        return None
    shard = built["dp_shard_cp"]
    if not config.dp_replicate_enabled:
        return shard
    from torch.distributed.device_mesh import DeviceMesh

    # joins the two existing 1-D meshes (their groups, no new ones) without slicing a flattened view from the
    # root, which torch 2.13 warns will go; the result keeps the root mesh, as fully_shard's TP check needs
    return DeviceMesh._concatenate([built["dp_replicate"], shard])


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's ``_no_split_modules`` instances (its decoder layers), children before parents."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in names]


def parallelize(
    model: nn.Module,
    built: ParallelMesh | None,
    config: ParallelismConfig,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    plan: dict[str, str] | None = None,
    units: list[nn.Module] | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` in place on ``built`` as ``config`` says and return it: tensor parallelism by ``plan`` (default
    the model's own) when ``tp_size > 1``, then ``fully_shard`` on each of ``units`` in order (default: the decoder
    layers; the FSDP strategy passes its wrap targets, LoRA's trainable leaves first), then the root. Without a shard
    dimension the model is returned after tensor parallelism alone; replication alone returns it unchanged (wrap
    it with DDP over ``built["dp"]``); a model already FSDP-sharded is returned as it is."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if built is None:
        return model
    if config.tp_enabled:
        apply_tensor_parallel(model, built["tp"], plan)
    mesh = fsdp_mesh(built, config)
    sharded = any(isinstance(m, FSDPModule) for m in model.modules())
    if mesh is None or sharded or not any(p.requires_grad for p in model.parameters()):
        return model
    targets = decoder_layers(model) if units is None else list(units)
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
    }
    for module in targets:
        fully_shard(module, **kwargs)
    # the root's parameters (embeddings, head) are the first backward needs: torch's default keeps them gathered
    if reshard_after_forward is True and targets:
        kwargs["reshard_after_forward"] = None
    fully_shard(model, **kwargs)
    return model
