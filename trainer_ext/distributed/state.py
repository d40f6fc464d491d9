"""Process topology and the process group: who am I, how many are we, which device is mine.

Only the launcher's variables are read (torchrun, SLURM's srun, OpenMPI's mpirun); everything else is
passed in explicitly, so two states can be built side by side in one process (tests do).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from trainer_ext.env_vars import (
    GROUP_RANK,
    LOCAL_RANK,
    LOCAL_WORLD_SIZE,
    MASTER_ADDR,
    MASTER_PORT,
    NODE_RANK,
    RANK,
    WORLD_SIZE,
)
from trainer_ext.errors import ConfigError


class DistributedType(str, Enum):
    """How the processes cooperate: accelerate 1.15's members and values, so scripts' and transformers' comparisons
    hold (we select NO, MULTI_CPU, MULTI_GPU, DEEPSPEED or FSDP; the others exist to be compared against)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job; ``source`` names the launcher the values came from."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    source: str = "single"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def launched(self) -> bool:
        """A launcher started this process (torchrun, srun, mpirun): its rendezvous makes a group, even of one."""
        return self.source != "single"

    @property
    def node_share(self) -> tuple[int, int]:
        """(this rank's index on its node, ranks on the node): how the ranks of a node split shared work."""
        return (self.local_rank, max(1, self.local_world_size))


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int | None:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {key}={value!r} is not an integer; fix or unset it") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[003-007,010],cpu1`` -> ``gpu003``, ``r[1-2]-n[4,6]`` -> ``r1-n4``."""
    text, host, i = nodelist.strip(), "", 0
    while i < len(text) and text[i] != ",":
        if text[i] == "[":
            end = text.find("]", i)
            if end < 0:
                host = ""
                break
            host += text[i + 1 : end].split(",")[0].split("-")[0]
            i = end + 1
        else:
            host += text[i]
            i += 1
    if not host:
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR explicitly")
    return host


def detect_topology(environ: Mapping[str, str] | None = None) -> Topology:
    """Read the topology from torchrun, then OpenMPI, then SLURM (inside ``srun``), else one process."""
    env = os.environ if environ is None else environ
    port = _int(env, MASTER_PORT)
    if RANK in env and WORLD_SIZE in env:
        world = _int(env, WORLD_SIZE, 1)
        local_world = _int(env, LOCAL_WORLD_SIZE, world)
        return Topology(
            rank=_int(env, RANK, 0),
            local_rank=_int(env, LOCAL_RANK, 0),
            world_size=world,
            local_world_size=local_world,
            node_rank=_int(env, GROUP_RANK, _int(env, NODE_RANK, 0)),
            num_nodes=max(1, world // max(1, local_world)),
            master_addr=env.get(MASTER_ADDR),
            master_port=port,
            source="torchrun",
        )
    if "OMPI_COMM_WORLD_SIZE" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE", 1)
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
        rank = _int(env, "OMPI_COMM_WORLD_RANK", 0)
        return Topology(
            rank=rank,
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
            world_size=world,
            local_world_size=local_world,
            node_rank=rank // max(1, local_world),
            num_nodes=max(1, world // max(1, local_world)),
            master_addr=env.get(MASTER_ADDR),
            master_port=port,
            source="openmpi",
        )
    if "SLURM_STEP_ID" in env and _int(env, "SLURM_NTASKS", 1) > 1:
        world = _int(env, "SLURM_NTASKS", 1)
        nodes = _int(env, "SLURM_NNODES", 1)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or ""
        addr = env.get(MASTER_ADDR) or (first_slurm_host(nodelist) if nodelist else None)
        return Topology(
            rank=_int(env, "SLURM_PROCID", 0),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            world_size=world,
            local_world_size=max(1, world // max(1, nodes)),
            node_rank=_int(env, "SLURM_NODEID", 0),
            num_nodes=nodes,
            master_addr=addr,
            master_port=port,
            source="slurm",
        )
    return Topology()


def choose_device(topology: Topology, cpu: bool = False) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is there, else ``mps`` for one process, else plain ``cpu``."""
    if not cpu and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count == 1:  # one GPU visible per process (e.g. SLURM --gpus-per-task=1): it is ours
            return torch.device("cuda", 0)
        if topology.local_rank >= count:
            raise ConfigError(
                f"local rank {topology.local_rank} has no GPU: only {count} visible. Start at most {count} "
                "processes per node, or pass --use_cpu"
            )
        return torch.device("cuda", topology.local_rank)
    if not cpu and topology.world_size == 1 and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


# how long the main thread lets go of the GIL after a destroy, so gloo's worker threads can drop their last works
# (they need microseconds; the margin is for a loaded machine)
GLOO_DRAIN_SECONDS = 0.1


# what a backend runs right after the default group is destroyed, to let go of the groups it still refers to
AFTER_DESTROY: list[Callable[[], None]] = []


def release_groups_after_destroy(release: Callable[[], None]) -> None:
    """Have :func:`destroy_process_group` call ``release`` once the default group is gone (once per function)."""
    if release not in AFTER_DESTROY:
        AFTER_DESTROY.append(release)


def destroy_process_group() -> None:
    """Destroy the default group and let go of every group a backend still refers to (its ``AFTER_DESTROY`` hook).

    A gloo group whose last reference outlives the destroy (a backend's module globals, a DDP reducer, a device
    mesh) keeps its worker threads. A worker frees a finished collective's tensors after the caller's ``wait``
    has returned, and freeing a tensor that Python also knew takes the GIL: if the interpreter is already being
    torn down by then, the thread dies inside a destructor and the process aborts (SIGABRT, "terminate called
    without an active exception"; gdb shows ``~AsyncWork`` in ``ProcessGroupGloo::runLoop``). So: collect the
    cycles that hold groups first, and give those threads a moment with the GIL free after the destroy.
    """
    gc.collect()
    dist.destroy_process_group()
    for release in AFTER_DESTROY:
        release()
    gc.collect()
    time.sleep(GLOO_DRAIN_SECONDS)  # gloo serves CPU tensors under NCCL too (our host group), so always


class DistState:
    """The distributed state of this process: topology, device, backend and the process group.

    ``init=False`` reads the topology without touching ``torch.distributed`` (for tests and dry runs).
    """

    deepspeed_plugin: Any = None  # accelerate's AcceleratorState.deepspeed_plugin: set by a DeepSpeed Accelerator
    fsdp_plugin: Any = None  # accelerate's AcceleratorState.fsdp_plugin: set by an FSDP Accelerator
    # accelerate's AcceleratorState.mixed_precision, and the backend an Accelerator trains with (FSDP, DEEPSPEED …):
    # set by an Accelerator, shown by str()
    mixed_precision: str | None = None
    strategy_type: DistributedType | None = None

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        cpu: bool = False,
        backend: str | None = None,
        timeout: timedelta | None = None,
        init: bool = True,
    ) -> None:
        self.topology = topology if topology is not None else detect_topology()
        self.device = choose_device(self.topology, cpu=cpu)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.timeout = timeout
        self.owns_process_group = False
        self.single_process_group = False  # one process that uses a process group of its own (FSDP's mesh)
        self._host_group: tuple[Any, Any] | None = None  # (the default group it was made for, a gloo group)
        self._saved_env: dict[str, str | None] = {}  # the launcher variables a group of one replaced
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if init and self.topology.is_distributed:
            self._init_process_group()

    @property
    def launched(self) -> bool:
        """This process can have a process group: a launcher started it, or one exists already."""
        return self.topology.launched or (dist.is_available() and dist.is_initialized())

    def join_process_group(self) -> None:
        """Use a process group even for one process, as accelerate does under a launcher (FSDP2's device mesh and
        ``torch.distributed.checkpoint`` need one): the existing group, one made from the launcher's variables, or,
        for a process no launcher started, a group of one on loopback (:meth:`_start_group_of_one`).

        A no-op for several processes (their group starts with the state).
        """
        if self.topology.is_distributed or self.single_process_group:
            return
        if self.launched:
            self._init_process_group()
        else:
            self._start_group_of_one()
        self.single_process_group = True

    def _start_group_of_one(self) -> None:
        """A group of world size 1 on a loopback store (a free port), with the variables torchrun would set, so
        code that reads them later sees the same world; both are undone when this state destroys the group."""
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)  # port 0: a free one
        values = {RANK: "0", LOCAL_RANK: "0", GROUP_RANK: "0", WORLD_SIZE: "1", LOCAL_WORLD_SIZE: "1"}
        values |= {MASTER_ADDR: "127.0.0.1", MASTER_PORT: str(store.port)}
        kwargs: dict = {"backend": self.backend, "store": store, "rank": 0, "world_size": 1}
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        if self.device.type == "cuda":
            kwargs["device_id"] = self.device
        dist.init_process_group(**kwargs)
        self._saved_env = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        self.owns_process_group = True
        atexit.register(self._destroy_at_exit)

    def _restore_env(self) -> None:
        """Put back the launcher variables :meth:`_start_group_of_one` set (a later state sees no launcher)."""
        for key, value in getattr(self, "_saved_env", {}).items():  # a state unpickled from an older version has none
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}

    def _init_process_group(self) -> None:
        if dist.is_initialized():
            if dist.get_world_size() != self.topology.world_size:
                raise ConfigError(
                    f"a process group of size {dist.get_world_size()} already exists but the launcher says "
                    f"{self.topology.world_size} processes"
                )
            return
        kwargs: dict = {"backend": self.backend}
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        if self.topology.source == "torchrun":
            kwargs["init_method"] = "env://"
        else:
            if not self.topology.master_addr:
                raise ConfigError(
                    f"{self.topology.world_size} processes were started by {self.topology.source} but MASTER_ADDR "
                    "is not set; export MASTER_ADDR=<host of rank 0> (and MASTER_PORT) before launching"
                )
            port = self.topology.master_port or 29500
            kwargs["init_method"] = f"tcp://{self.topology.master_addr}:{port}"
            kwargs["rank"] = self.topology.rank
            kwargs["world_size"] = self.topology.world_size
        if self.device.type == "cuda":
            kwargs["device_id"] = self.device
        dist.init_process_group(**kwargs)
        self.owns_process_group = True
        # gloo worker threads still holding tensors at interpreter teardown abort the process (SIGABRT);
        # tearing the group down while Python is alive avoids it when the user never calls destroy().
        atexit.register(self._destroy_at_exit)

    def _destroy_at_exit(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            destroy_process_group()
        self.owns_process_group = False
        self._restore_env()

    # -- who am I -----------------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        return self.topology.world_size

    @property
    def process_index(self) -> int:
        return self.topology.rank

    @property
    def local_process_index(self) -> int:
        return self.topology.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.topology.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.topology.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        return self.topology.rank == self.topology.world_size - 1

    @property
    def use_distributed(self) -> bool:
        return self.topology.is_distributed

    @property
    def distributed_type(self) -> DistributedType:
        """NO for one process, unless it joined a process group (then MULTI_*: transformers' parallel_mode is
        DISTRIBUTED, as under accelerate for a launched process)."""
        if not (self.topology.is_distributed or self.single_process_group):
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    # -- synchronisation ------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """Barrier across all processes; a no-op for one process. Every rank must call it."""
        if self.topology.is_distributed and dist.is_initialized():
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self, local: bool = False) -> Iterator[None]:
        """Run the block on the (local) main process first, then on the others (e.g. dataset caching)."""
        is_main = self.is_local_main_process if local else self.is_main_process
        if not is_main:
            self.wait_for_everyone()
        try:
            yield
        finally:
            if is_main:  # release the others even when the main process fails, so they do not hang
                self.wait_for_everyone()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.main_process_first(local=True)

    def host_group(self) -> Any:
        """A gloo group over all ranks for small CPU-side agreements (flags), so they never sync the GPU.

        ``None`` where the default group already reduces CPU tensors (gloo) or there is no group. Collective the
        first time for a default group (every rank calls it at the same point); kept for the next calls.
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        if dist.get_backend() == "gloo":
            return None
        world = dist.GroupMember.WORLD
        if self._host_group is None or self._host_group[0] is not world:
            self._host_group = (world, dist.new_group(backend="gloo"))
        return self._host_group[1]

    def destroy(self) -> None:
        """Tear down the process group if this state created it."""
        if self.owns_process_group and dist.is_initialized():
            # a rank leaving while another is still in a collective aborts the job (gloo): meet first,
            # and drop dead DDP reducers (which hold pending work) before the group goes
            gc.collect()
            self.wait_for_everyone()
            destroy_process_group()
        self.owns_process_group = False
        self._host_group = None
        self._restore_env()

    # -- pickling: transformers saves ``args`` (which holds this state) into training_args.bin ----
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["owns_process_group"] = False
        state["_host_group"] = None  # a live group does not travel
        state["_saved_env"] = {}  # nor the environment it replaced
        return state

    def __str__(self) -> str:
        """The summary ``print(accelerator.state)`` shows under accelerate (its lines, our values); an Accelerator's
        state adds the mixed precision (and DeepSpeed's config), as accelerate's AcceleratorState does."""
        grouped = self.topology.is_distributed or self.single_process_group
        backend = f"  Backend: {self.backend}" if grouped else ""
        text = (
            f"Distributed environment: {self.strategy_type or self.distributed_type}{backend}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )
        if self.mixed_precision is not None:
            text += f"\nMixed precision type: {self.mixed_precision}\n"
            if self.strategy_type == DistributedType.DEEPSPEED and self.deepspeed_plugin is not None:
                text += f"ds_config: {self.deepspeed_plugin.deepspeed_config}\n"
        return text

    def __repr__(self) -> str:
        t = self.topology
        return (
            f"DistState(rank={t.rank}/{t.world_size}, local_rank={t.local_rank}, nodes={t.num_nodes}, "
            f"device={self.device}, backend={self.backend}, launcher={t.source})"
        )
