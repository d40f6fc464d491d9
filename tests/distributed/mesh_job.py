"""Rank job: builds the device mesh of each ``ParallelismConfig`` named on the command line and writes what this
rank sees (coordinates, the ranks of each dimension's and view's group) to OUT/rank<R>.json.

    python -m torch.distributed.run --nproc_per_node 4 -m tests.distributed.mesh_job OUT 2,2,1 1,2,2

Each config is ``dp_replicate,dp_shard,tp``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch.distributed as dist

from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.distributed.mesh.device_mesh import build_parallel_mesh
from trainer_ext.errors import ConfigError


def _seen(spec: str) -> dict:
    replicate, shard, tp = (int(x) for x in spec.split(","))
    try:
        config = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp)
        built = build_parallel_mesh(config, "cpu")
    except ConfigError as exc:
        return {"error": str(exc)}
    if built is None:
        return {"mesh": None}
    mesh = built.mesh
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slicing a flattened view from the root: torch warns it will go
        sliced = {name: mesh[name].size() for name in built.views}
    return {
        "names": list(mesh.mesh_dim_names),
        "shape": list(mesh.shape),
        "coordinate": mesh.get_coordinate(),
        "groups": {name: dist.get_process_group_ranks(view.get_group()) for name, view in built.views.items()},
        "local_ranks": {name: view.get_local_rank() for name, view in built.views.items()},
        "sliced_sizes": sliced,
    }


def main(out: str, *specs: str) -> None:
    dist.init_process_group("gloo")
    seen = {spec: _seen(spec) for spec in specs}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
