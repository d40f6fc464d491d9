"""Tier 1: topology detection from launcher environments and DistState without a process group."""

from __future__ import annotations

import pickle
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainer_ext.distributed import DistributedType, DistState, Topology, detect_topology
from trainer_ext.distributed.state import first_slurm_host
from trainer_ext.errors import ConfigError

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29501",
}
OMPI = {
    "OMPI_COMM_WORLD_SIZE": "6",
    "OMPI_COMM_WORLD_RANK": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
}
SLURM_SRUN = {
    "SLURM_JOB_ID": "42",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_NODELIST": "gpu[003-007,010],cpu1",
    "MASTER_PORT": "12345",
}
SLURM_SBATCH = {k: v for k, v in SLURM_SRUN.items() if k != "SLURM_STEP_ID"}


@pytest.mark.parametrize(
    "env, expected",
    [
        pytest.param({}, Topology(), id="empty"),
        pytest.param(
            TORCHRUN,
            Topology(5, 1, 8, 4, 1, 2, "node0", 29501, "torchrun"),
            id="torchrun",
        ),
        pytest.param(
            {"RANK": "0", "WORLD_SIZE": "1"},
            Topology(source="torchrun"),
            id="torchrun-one-process",
        ),
        pytest.param(
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1"},
            Topology(3, 1, 4, 2, 1, 2, None, None, "torchrun"),
            id="torchrun-node-rank-fallback",
        ),
        pytest.param(
            {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2"},
            Topology(2, 2, 3, 3, 0, 1, None, None, "torchrun"),
            id="torchrun-local-world-defaults-to-world",
        ),
        pytest.param(OMPI, Topology(4, 1, 6, 3, 1, 2, None, None, "openmpi"), id="openmpi"),
        pytest.param(
            {**OMPI, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "2222"},
            Topology(4, 1, 6, 3, 1, 2, "10.0.0.1", 2222, "openmpi"),
            id="openmpi-master",
        ),
        pytest.param(SLURM_SRUN, Topology(6, 2, 8, 4, 1, 2, "gpu003", 12345, "slurm"), id="slurm-srun"),
        pytest.param(
            {**SLURM_SRUN, "SLURM_STEP_NODELIST": "node[17-18]"},
            Topology(6, 2, 8, 4, 1, 2, "node17", 12345, "slurm"),
            id="slurm-step-nodelist-preferred",
        ),
        pytest.param(
            {**SLURM_SRUN, "MASTER_ADDR": "head"},
            Topology(6, 2, 8, 4, 1, 2, "head", 12345, "slurm"),
            id="slurm-master-addr-wins",
        ),
        pytest.param(
            {k: v for k, v in SLURM_SRUN.items() if k != "SLURM_NODELIST"},
            Topology(6, 2, 8, 4, 1, 2, None, 12345, "slurm"),
            id="slurm-no-nodelist",
        ),
        pytest.param(SLURM_SBATCH, Topology(), id="sbatch-without-srun-is-single"),
        pytest.param({**SLURM_SRUN, "SLURM_NTASKS": "1"}, Topology(), id="srun-one-task"),
        # precedence: torchrun > OpenMPI > SLURM
        pytest.param(
            {**SLURM_SRUN, **TORCHRUN},
            Topology(5, 1, 8, 4, 1, 2, "node0", 29501, "torchrun"),
            id="torchrun-beats-slurm",
        ),
        pytest.param(
            {**SLURM_SRUN, **OMPI},
            Topology(4, 1, 6, 3, 1, 2, None, 12345, "openmpi"),
            id="openmpi-beats-slurm",
        ),
        pytest.param(
            {**OMPI, **TORCHRUN},
            Topology(5, 1, 8, 4, 1, 2, "node0", 29501, "torchrun"),
            id="torchrun-beats-openmpi",
        ),
    ],
)
def test_detect_topology(env: dict[str, str], expected: Topology) -> None:
    assert detect_topology(env) == expected
    assert detect_topology(env).is_distributed == (expected.world_size > 1)


def test_detect_topology_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    assert detect_topology() == Topology()
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    assert detect_topology() == Topology(5, 1, 8, 4, 1, 2, "node0", 29501, "torchrun")


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("gpu[003-007,010],cpu1", "gpu003"),
        ("node1", "node1"),
        ("cpu1,gpu[1-2]", "cpu1"),
        ("n[7]", "n7"),
        ("a[1,3-4]", "a1"),
        ("rack1-n[10-12]", "rack1-n10"),
        (" node5 ", "node5"),
    ],
)
def test_first_slurm_host(nodelist: str, host: str) -> None:
    assert first_slurm_host(nodelist) == host


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node[1-2]-ib", "node1-ib"),
        ("rack[01-3]-node[01-2,5]", "rack01-node01"),
        ("gpu[1-2].cluster,x", "gpu1.cluster"),
    ],
)
def test_first_slurm_host_with_suffix(nodelist: str, host: str) -> None:
    assert first_slurm_host(nodelist) == host


@pytest.mark.parametrize(
    "env, key",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0.5"}, "LOCAL_RANK"),
        ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "r1"}, "OMPI_COMM_WORLD_RANK"),
        ({**SLURM_SRUN, "SLURM_PROCID": "six"}, "SLURM_PROCID"),
        ({**SLURM_SRUN, "SLURM_NTASKS": "8x"}, "SLURM_NTASKS"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT"),
    ],
)
def test_bad_integer_is_config_error(env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key}=.*not an integer"):
        detect_topology(env)


# -- DistState without a process group ----------------------------------------------------------------


def _topo(rank: int, world: int, local_rank: int | None = None, local_world: int | None = None) -> Topology:
    local_world = local_world or world
    return Topology(
        rank=rank,
        local_rank=rank % local_world if local_rank is None else local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=rank // local_world,
        num_nodes=world // local_world,
        master_addr="127.0.0.1",
        master_port=29500,
        source="torchrun",
    )


@pytest.mark.parametrize(
    "topology, main, local_main, last, dtype",
    [
        (Topology(), True, True, True, DistributedType.NO),
        (_topo(0, 4), True, True, False, DistributedType.MULTI_CPU),
        (_topo(1, 4), False, False, False, DistributedType.MULTI_CPU),
        (_topo(2, 4, local_world=2), False, True, False, DistributedType.MULTI_CPU),
        (_topo(3, 4), False, False, True, DistributedType.MULTI_CPU),
    ],
)
def test_dist_state_without_init(
    topology: Topology, main: bool, local_main: bool, last: bool, dtype: DistributedType
) -> None:
    state = DistState(topology, cpu=True, init=False)
    assert state.device == torch.device("cpu")
    assert str(state.device) == "cpu" and state.device.index is None
    assert state.backend == "gloo"
    assert state.is_main_process is main
    assert state.is_local_main_process is local_main
    assert state.is_last_process is last
    assert state.num_processes == topology.world_size
    assert state.process_index == topology.rank
    assert state.local_process_index == topology.local_rank
    assert state.use_distributed is (topology.world_size > 1)
    assert state.distributed_type is dtype
    assert state.owns_process_group is False
    assert not dist.is_initialized()


def test_dist_state_rank1_of_4_defaults() -> None:
    """Rank 1 of 4 on a machine without a GPU: plain cpu (not cpu:0), gloo, MULTI_CPU."""
    state = DistState(_topo(1, 4), init=False)
    assert str(state.device) == "cpu"
    assert state.backend == "gloo"
    assert (state.is_main_process, state.is_local_main_process, state.num_processes) == (False, False, 4)
    assert state.distributed_type == "MULTI_CPU"
    assert "rank=1/4" in repr(state) and "launcher=torchrun" in repr(state)


def test_default_state_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DistState(cpu=True, init=False).topology == Topology()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    state = DistState(cpu=True, init=False)
    assert (state.process_index, state.num_processes, state.local_process_index) == (1, 2, 1)


def test_backend_override() -> None:
    assert DistState(_topo(0, 2), cpu=True, backend="mpi", init=False).backend == "mpi"


def test_two_states_side_by_side() -> None:
    a = DistState(_topo(0, 2), cpu=True, init=False)
    b = DistState(_topo(1, 2), cpu=True, init=False)
    single = DistState(Topology(), cpu=True, init=False)
    assert (a.process_index, b.process_index, single.process_index) == (0, 1, 0)
    assert (a.is_main_process, b.is_main_process) == (True, False)
    assert (a.num_processes, b.num_processes, single.num_processes) == (2, 2, 1)
    assert single.distributed_type is DistributedType.NO
    assert a.distributed_type is b.distributed_type is DistributedType.MULTI_CPU
    assert a.topology is not b.topology


def test_pickle_round_trip() -> None:
    state = DistState(_topo(1, 4), cpu=True, timeout=timedelta(minutes=3), init=False)
    state.owns_process_group = True  # as if this process had created the group
    clone = pickle.loads(pickle.dumps(state))
    assert isinstance(clone, DistState)
    assert clone.topology == state.topology
    assert clone.device == state.device
    assert clone.backend == "gloo"
    assert clone.timeout == timedelta(minutes=3)
    assert clone.owns_process_group is False  # a loaded copy never tears down someone's group
    assert state.owns_process_group is True  # pickling does not change the original
    assert clone.process_index == 1 and clone.distributed_type is DistributedType.MULTI_CPU
    state.owns_process_group = False


def test_main_process_first_single_process() -> None:
    state = DistState(Topology(), cpu=True, init=False)
    ran = []
    with state.main_process_first():
        ran.append("body")
    with state.local_main_process_first():
        ran.append("local")
    state.wait_for_everyone()  # no process group: a no-op, not an error
    assert ran == ["body", "local"]


@pytest.mark.parametrize(
    "topology, local, order",
    [
        (Topology(), False, ["body", "wait"]),
        (_topo(0, 2), False, ["body", "wait"]),
        (_topo(1, 2), False, ["wait", "body"]),
        (_topo(2, 4, local_world=2), False, ["wait", "body"]),  # not the global main ...
        (_topo(2, 4, local_world=2), True, ["body", "wait"]),  # ... but the main of its node
    ],
)
def test_main_process_first_order(
    monkeypatch: pytest.MonkeyPatch, topology: Topology, local: bool, order: list[str]
) -> None:
    state = DistState(topology, cpu=True, init=False)
    calls: list[str] = []
    monkeypatch.setattr(state, "wait_for_everyone", lambda: calls.append("wait"))
    with state.main_process_first(local=local):
        calls.append("body")
    assert calls == order


def _no_network(*args: object, **kwargs: object) -> None:
    raise AssertionError("init_process_group must not be called when MASTER_ADDR is missing")


@pytest.mark.parametrize(
    "env, launcher",
    [
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, "openmpi"),
        ({k: v for k, v in SLURM_SRUN.items() if k != "SLURM_NODELIST"}, "slurm"),
    ],
)
def test_missing_master_addr_fails_before_network(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], launcher: str
) -> None:
    monkeypatch.setattr(dist, "init_process_group", _no_network)
    topology = detect_topology(env)
    assert topology.source == launcher and topology.master_addr is None and topology.world_size > 1
    with pytest.raises(ConfigError, match=rf"started by {launcher} but MASTER_ADDR is not set.*export MASTER_ADDR"):
        DistState(topology, cpu=True, init=True)
    assert not dist.is_initialized()


def test_single_process_init_true_creates_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "init_process_group", _no_network)
    state = DistState(Topology(), cpu=True, init=True)
    assert state.owns_process_group is False and not dist.is_initialized()
    state.destroy()  # nothing to tear down
    assert not dist.is_initialized()
