"""The start-up block with a parallelism config: the mesh, the data-parallel ranks, and the batch they multiply."""

from __future__ import annotations

from types import SimpleNamespace

from trainer_ext.callbacks.run_summary import _context_parallel, _mesh, run_summary
from trainer_ext.distributed.mesh.config import ParallelismConfig

COMMON = dict(
    per_device_batch=8,
    accumulation=2,
    batches_per_epoch=10,
    max_steps=5,
    precision="no",
    strategy="fsdp2",
    schedule="linear with 0 warm-up steps",
)


def test_tensor_parallel_ranks_share_a_batch_so_only_data_parallel_ranks_multiply_it():
    engine = SimpleNamespace(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    mesh, ranks = _mesh(engine, 4)
    assert (mesh, ranks) == ("dp_shard 2 x tp 2", 2)
    lines = run_summary(world_size=4, mesh=mesh, data_parallel=ranks, **COMMON).splitlines()
    assert "  mesh                    = dp_shard 2 x tp 2" in lines
    assert "  data-parallel ranks     = 2 (world 4 / 2: the ranks of one tensor-parallel group share a batch)" in lines
    assert "  global batch (samples)  = 32 = 2 x 8 x 2" in lines


def test_without_a_parallelism_config_the_block_is_as_before():
    assert _mesh(SimpleNamespace(), 4) == (None, None)  # an engine without the attribute (before the wiring)
    assert _mesh(SimpleNamespace(parallelism_config=None), 4) == (None, None)
    text = run_summary(world_size=4, **COMMON)
    assert "mesh" not in text and "global batch (samples)  = 64 = 4 x 8 x 2" in text


def test_sizes_all_one_on_several_processes_replicate():
    mesh, ranks = _mesh(SimpleNamespace(parallelism_config=ParallelismConfig(tp_size=1)), 4)
    assert (mesh, ranks) == ("dp_replicate 4", 4)
    lines = run_summary(world_size=4, mesh=mesh, data_parallel=ranks, **COMMON).splitlines()
    assert "  data-parallel ranks     = 4" in lines and "  global batch (samples)  = 64 = 4 x 8 x 2" in lines


def test_context_parallel_ranks_share_a_batch_and_the_attention_is_named():
    config = ParallelismConfig(dp_shard_size=2, cp_size=2)
    engine = SimpleNamespace(parallelism_config=config, cp_backend="all_gather")
    mesh, ranks = _mesh(engine, 4)
    assert (mesh, ranks) == ("dp_shard 2 x cp 2", 2)
    lines = run_summary(
        world_size=4, mesh=mesh, data_parallel=ranks, context_parallel=_context_parallel(engine), **COMMON
    ).splitlines()
    assert (
        "  data-parallel ranks     = 2 (world 4 / 2: the ranks of one context-parallel group share a batch)" in lines
    )
    assert "  context parallel        = 2 ranks, all_gather attention (auto)" in lines
    assert "  global batch (samples)  = 32 = 2 x 8 x 2" in lines
    # the backend asked for by name is not repeated; tp and cp together share a batch over both
    engine = SimpleNamespace(parallelism_config=ParallelismConfig(cp_size=2, cp_backend="torch"), cp_backend="torch")
    assert _context_parallel(engine) == "2 ranks, torch attention"
    mesh, ranks = _mesh(SimpleNamespace(parallelism_config=ParallelismConfig(cp_size=2, tp_size=2)), 4)
    text = run_summary(world_size=4, mesh=mesh, data_parallel=ranks, **COMMON)
    assert "(world 4 / 4: the ranks of one tensor- and context-parallel group share a batch)" in text


def test_without_context_parallelism_there_is_no_cp_line():
    engine = SimpleNamespace(parallelism_config=ParallelismConfig(tp_size=2), cp_backend=None)
    assert _context_parallel(engine) is None
    assert _context_parallel(SimpleNamespace(parallelism_config=None)) is None  # an engine without cp_backend
    mesh, ranks = _mesh(engine, 2)
    assert "context parallel" not in run_summary(world_size=2, mesh=mesh, data_parallel=ranks, **COMMON)
