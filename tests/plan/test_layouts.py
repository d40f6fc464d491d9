"""The planner's layouts: each one's train flags, read as ``train`` reads them, give the Setup the plan estimated; the
enumeration lists only what the engine runs; the cluster's links and the interconnect flag."""

from __future__ import annotations

import pytest

from trainer_ext.errors import ConfigError
from trainer_ext.estimate.setup import setup_from_values
from trainer_ext.job.flags import parse_train_values
from trainer_ext.plan.cluster import Cluster, parse_interconnect
from trainer_ext.plan.layouts import Layout, families, fixed_by_flags, model_sizes
from trainer_ext.plan.planner import candidate_setup

LAYOUTS = [
    Layout("single"),
    Layout("ddp", dp_replicate=4, micro_batch=2, accumulation=3),
    Layout("fsdp", dp_shard=4, checkpointing=True),
    Layout("fsdp", dp_shard=4, reshard=False),
    Layout("fsdp", dp_shard=4, offload=True),
    Layout("fsdp", offload=True),
    Layout("hsdp", dp_replicate=2, dp_shard=4),
    Layout("fsdp", dp_shard=2, tp=2),
    Layout("hsdp", dp_replicate=2, dp_shard=2, tp=2),
    Layout("fsdp", tp=4),
    Layout("fsdp", dp_shard=2, cp=2),
    Layout("fsdp", dp_shard=2, pp=2, micro_batch=4, pp_microbatches=4),
    Layout("zero1", dp_replicate=4),
    Layout("zero2", dp_replicate=4),
    Layout("zero3", dp_replicate=4),
    Layout("zero2", dp_replicate=4, offload=True),
    Layout("zero3", dp_replicate=4, offload=True),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name())
def test_the_flags_of_a_layout_give_the_setup_the_plan_estimated(layout: Layout) -> None:
    """The command's flags (the shipped DeepSpeed files included) parsed by train's parser give the same Setup as
    the layout's values the plan estimated: the printed command runs what was estimated."""
    job_flags = ["--task", "causal-lm", "--bf16"]
    values, extras, _ = parse_train_values([*job_flags, *layout.flags()])
    assert extras == []
    from_flags = setup_from_values(values, layout.world, 128)
    base, _, _ = parse_train_values(job_flags)
    assert candidate_setup(base, layout, 128, "cpu") == from_flags
    assert from_flags.world_size == layout.world
    assert from_flags.data_parallel == layout.data_parallel


def test_a_layout_knows_its_process_groups_and_their_strides() -> None:
    layout = Layout("hsdp", dp_replicate=2, dp_shard=2, pp=2, tp=2)
    assert layout.world == 16
    assert layout.dimensions() == [("tp", 2, 1), ("pp", 2, 2), ("dp_shard", 2, 4), ("dp_replicate", 2, 8)]
    assert Layout("ddp", dp_replicate=8).dimensions() == [("dp", 8, 1)]


def test_links_follow_the_machines_a_group_spans() -> None:
    cluster = Cluster(num_machines=2, per_machine=8, intra="nvlink", inter="ib")
    assert cluster.link(1, 8) == "nvlink"  # tp 8: one machine
    assert cluster.link(8, 2) == "ib"  # the replicas of 8-rank shards: across machines
    assert cluster.link(1, 16) == "ib"
    assert Cluster(num_machines=1, per_machine=8).link(1, 8) == "nvlink"


def test_the_interconnect_flag() -> None:
    assert parse_interconnect(None, 1) == ("nvlink", "ib")
    assert parse_interconnect("pcie", 1) == ("pcie", "ib")
    assert parse_interconnect("ethernet", 2) == ("nvlink", "ethernet")
    assert parse_interconnect("pcie,ib", 2) == ("pcie", "ib")
    assert parse_interconnect(None, 1, device="cpu")[0] == "shm"
    with pytest.raises(ConfigError, match="--interconnect 'token-ring'"):
        parse_interconnect("token-ring", 2)


def test_model_parallel_sizes_stay_within_a_machine_and_never_pair_cp_with_pp() -> None:
    cluster = Cluster(num_machines=2, per_machine=4)
    sizes = list(model_sizes(cluster, lambda name, size: None, {}))
    assert all(4 % tp == 0 for tp, _, _ in sizes)  # tp 8 would span the two machines
    assert not any(cp > 1 and pp > 1 for _, cp, pp in sizes)
    assert (1, 1, 8) in sizes and (2, 2, 1) in sizes and (4, 1, 2) in sizes
    refused = list(model_sizes(cluster, lambda name, size: "no" if name == "pp" and size > 2 else None, {}))
    assert max(pp for _, _, pp in refused) == 2
    assert {tp for tp, _, _ in model_sizes(cluster, lambda n, s: None, {"tp_size": 2})} == {2}


def test_deepspeed_and_ddp_only_without_model_parallel_sizes() -> None:
    pure = {layout.family for layout in families(8, 1, 1, 1, {})}
    assert pure == {"ddp", "fsdp", "hsdp", "zero1", "zero2", "zero3"}
    meshed = list(families(8, 2, 1, 1, {}))
    assert {layout.family for layout in meshed} == {"fsdp", "hsdp"}
    assert all(layout.world == 8 and layout.tp == 2 for layout in meshed)
    assert {(layout.family, layout.offload) for layout in families(1, 1, 1, 1, {})} == {
        ("single", False),
        ("fsdp", True),
    }


def test_the_users_own_layout_flags_fix_that_part() -> None:
    values, _, _ = parse_train_values(["--deepspeed", "configs/deepspeed/zero3_offload.json"])
    fixed = fixed_by_flags(values)
    assert {(layout.family, layout.offload) for layout in families(4, 1, 1, 1, fixed)} == {("zero3", True)}
    values, _, _ = parse_train_values(["--fsdp", "shard_grad_op"])
    kept = list(families(4, 1, 1, 1, fixed_by_flags(values)))
    assert kept and all(layout.family in ("fsdp", "hsdp") and not layout.reshard for layout in kept)
    values, _, _ = parse_train_values(["--dp_replicate_size", "2"])
    assert {layout.family for layout in families(8, 1, 1, 1, fixed_by_flags(values))} == {"hsdp"}
