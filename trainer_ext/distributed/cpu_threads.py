"""CPU threads per process: the cores this process may use and nobody else is using, shared among the training
processes of its machine.

torch's default (every physical core per process, OpenMP threads that spin while they wait) is ruinous where the
cores are shared: several processes on one machine, or a machine other jobs also use (benchmarks/threads.py). The
policy, applied by ``trainer-ext train`` and ``trainer-ext launch`` before torch is imported (and by
``trainer_ext.train`` on torch's own setting): the usable cores less the load already on them (the 1-minute load
average, in proportion to the cores this process may use), divided among the local training processes, at least 1
and at most ``cores // local processes``; and ``OMP_WAIT_POLICY=PASSIVE``, so that an idle thread sleeps instead of
spinning. ``OMP_NUM_THREADS`` (or ``--num_cpu_threads_per_process`` on ``launch``) and ``OMP_WAIT_POLICY`` set by
the user win. Leaf module: imports nothing heavy, so the CLI runs it first.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass

NUM_THREADS = "OMP_NUM_THREADS"
WAIT_POLICY = "OMP_WAIT_POLICY"
# set by our launcher and CLI beside OMP_NUM_THREADS: where the value came from (a key of SOURCES)
SOURCE = "TRAINER_EXT_THREADS_SOURCE"
SOURCES = {
    "policy": "trainer_ext's default: the idle usable cores / training processes on this machine",
    "flag": "trainer-ext launch --num_cpu_threads_per_process",
    "gpu": "trainer-ext launch: 1 per GPU process, as torchrun and accelerate set it",
}
DEFAULT_WAIT_POLICY = "PASSIVE"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and schedulers restrict)."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


def local_processes(env: MutableMapping[str, str] | None = None) -> int:
    """Training processes on this machine: torchrun's LOCAL_WORLD_SIZE, 1 without a launcher."""
    env = os.environ if env is None else env
    return _positive_int(env.get("LOCAL_WORLD_SIZE")) or 1


@dataclass(frozen=True)
class ThreadPolicy:
    """Threads per process, the OpenMP wait policy, and where the thread count came from."""

    threads: int
    wait_policy: str | None
    source: str

    def describe(self) -> str:
        """One line for the start-up block."""
        wait = f", OpenMP wait policy {self.wait_policy}" if self.wait_policy else ""
        return f"{self.threads}{wait} ({self.source})"


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(str(text).strip())
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None


def busy_cores(cores: int) -> float:
    """The load already on ``cores`` of this machine: the 1-minute load average, in proportion to them."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform: count the cores as idle
        return 0.0
    return load * cores / max(os.cpu_count() or cores, cores)


def choose(
    local_processes: int = 1, env: MutableMapping[str, str] | None = None, busy: float | None = None
) -> ThreadPolicy:
    """The policy for one of ``local_processes`` training processes on this machine (``env``: os.environ; ``busy``:
    the cores other work keeps busy, measured when None)."""
    env = os.environ if env is None else env
    wait = env.get(WAIT_POLICY) or DEFAULT_WAIT_POLICY
    given = _positive_int(env.get(NUM_THREADS))
    if given is not None:
        return ThreadPolicy(given, wait, SOURCES.get(env.get(SOURCE, ""), f"{NUM_THREADS} set"))
    cores, local = usable_cores(), max(local_processes, 1)
    busy = busy_cores(cores) if busy is None else busy
    threads = max(1, min(cores // local, round(max(cores - busy, 0.0) / local)))
    return ThreadPolicy(
        threads, wait, f"{cores} usable cores, {busy:.1f} busy, / {local} processes; set {NUM_THREADS} to change"
    )


def apply_to_environment(local_processes: int = 1, env: MutableMapping[str, str] | None = None) -> ThreadPolicy:
    """Write the policy into ``env`` (os.environ) where the user set nothing; call before torch is imported."""
    env = os.environ if env is None else env
    policy = choose(local_processes, env)
    if _positive_int(env.get(NUM_THREADS)) is None:
        env[NUM_THREADS], env[SOURCE] = str(policy.threads), "policy"
    env.setdefault(WAIT_POLICY, DEFAULT_WAIT_POLICY)
    return policy


def apply_to_torch(local_processes: int = 1) -> ThreadPolicy:
    """Set torch's intra-op threads to the policy (torch already imported: the wait policy cannot change now)."""
    import torch

    policy = choose(local_processes)
    if torch.get_num_threads() != policy.threads:
        torch.set_num_threads(policy.threads)
    return current(local_processes)


def current(local_processes: int = 1) -> ThreadPolicy:
    """What this process runs with: torch's intra-op threads, the wait policy in effect, and why."""
    import torch

    policy = choose(local_processes)
    threads = torch.get_num_threads()
    source = policy.source if threads == policy.threads else "torch.set_num_threads"
    return ThreadPolicy(threads, os.environ.get(WAIT_POLICY), source)
