"""Resolved launch settings: command line over config file over defaults, each value with where it came from.

``resolve`` merges the layers, derives what follows from them (device, processes per machine) and
collects every problem it can find without starting anything: GPUs that are not there, fp16 on a CPU,
a machine rank out of range, a multi-machine run without a main address.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainer_ext.cli.launch.config_file import (
    MAX_PROCESSES_PER_MACHINE,
    PARALLEL_KEYS,
    PLAIN_KEYS,
    ConfigFile,
    whole_number,
)

DEFAULT = "default"
DEFAULTS: dict[str, Any] = {
    "num_machines": 1,
    "machine_rank": 0,
    "main_process_ip": None,
    "main_process_port": None,
    "rdzv_backend": "static",
    "rdzv_timeout": None,
    "max_restarts": 0,
    "cpu": False,
    "gpu_ids": None,
    "mixed_precision": "no",
    "gradient_accumulation_steps": None,
    "deepspeed": None,
    "fsdp": None,
    "fsdp_config": None,
    "debug": False,
    "require_gpu": False,
    "distributed_type": None,
    "num_cpu_threads_per_process": None,
    **dict.fromkeys(PARALLEL_KEYS),
}
SHOWN = (
    "num_machines",
    "machine_rank",
    "num_processes",
    "nproc_per_node",
    "device",
    "gpu_ids",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
    "rdzv_timeout",
    "max_restarts",
    "mixed_precision",
    "gradient_accumulation_steps",
    "deepspeed",
    "fsdp",
    "fsdp_config",
    "debug",
    "num_cpu_threads_per_process",
    "dp_replicate_size",
    "dp_shard_size",
    "tp_size",
    "cp_size",
    "cp_backend",
    "pp_size",
    "pp_schedule",
    "pp_microbatches",
)
PROCESS_KEYS = ("num_processes", "nproc_per_node")
# command-line values go through the same checks as config-file values
CONVERTERS = {
    **PLAIN_KEYS,
    "nproc_per_node": whole_number(1, MAX_PROCESSES_PER_MACHINE),
    "rdzv_timeout": whole_number(1, 7 * 24 * 3600),  # seconds: a week
    "num_cpu_threads_per_process": whole_number(1, MAX_PROCESSES_PER_MACHINE),
}


@dataclass
class Settings:
    """The launch settings after precedence, with ``sources[name]`` saying where each value came from."""

    values: dict[str, Any]
    sources: dict[str, str]
    gpu_count: int
    config_file: str = "none"
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.values.get(name)

    def given(self, name: str) -> bool:
        """True when the value was asked for (command line or config file), not a default or derived."""
        source = self.sources.get(name, DEFAULT)
        return not source.startswith((DEFAULT, "derived"))

    @property
    def world_size(self) -> int:
        return self.values["nproc_per_node"] * self.values["num_machines"]

    @property
    def gpus(self) -> list[int]:
        """The GPU indices the processes of this machine may use."""
        ids = self.values.get("gpu_ids")
        if ids in (None, "all"):
            return list(range(self.gpu_count))
        return [int(i) for i in ids.split(",")]

    def table(self) -> str:
        """One line per setting: name, value, source."""
        rows = [(name, _show(self.values.get(name)), self.sources.get(name, DEFAULT)) for name in SHOWN]
        width = max(len(r[1]) for r in rows)
        return "\n".join(f"  {n:<28} {v:<{width}}  {s}" for n, v, s in rows)


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "{inline mapping}"
    return str(value)


def visible_gpus() -> int:
    """CUDA devices torch can see (0 without a CUDA build or driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(cli: Mapping[str, tuple[Any, str]], config: ConfigFile | None, gpu_count: int | None = None) -> Settings:
    """Merge defaults < config file < command line (``cli`` maps name -> (value, flag)) and check the result."""
    values: dict[str, Any] = dict(DEFAULTS)
    sources = dict.fromkeys(DEFAULTS, DEFAULT)
    settings = Settings(values, sources, visible_gpus() if gpu_count is None else gpu_count)
    layers: list[tuple[dict[str, Any], dict[str, str]]] = []
    if config is not None:
        layers.append((dict(config.values), dict(config.sources)))
    given: dict[str, Any] = {}
    for name, (value, flag) in cli.items():
        try:
            given[name] = CONVERTERS[name](value) if name in CONVERTERS else value
        except ValueError as error:
            settings.problems.append(f"{flag}: {error}")
    layers.append((given, {k: f"command line {flag}" for k, (_, flag) in cli.items()}))
    for i, (layer_values, layer_sources) in enumerate(layers):
        later = [name for later_values, _ in layers[i + 1 :] for name in later_values]
        if any(name in later for name in PROCESS_KEYS):
            # the process count is one setting with two spellings: a later layer replaces both
            for name in PROCESS_KEYS:
                if name in layer_values:
                    settings.notes.append(f"{name} {layer_values.pop(name)} from {layer_sources[name]} is overridden")
        values.update(layer_values)
        sources.update({k: layer_sources[k] for k in layer_values})
    _derive_device(settings)
    _derive_processes(settings)
    _check(settings)
    _derive_rendezvous(settings)
    return settings


def _derive_rendezvous(s: Settings) -> None:
    """One machine always meets on loopback; several meet at the main address (static by default).

    One process needs no rendezvous, unless it may be restarted: torchrun's agent (on loopback) does that.
    """
    if s["num_machines"] > 1:
        if s["main_process_port"] is None:
            s.values["main_process_port"] = 29500
        return
    for name, used in (("main_process_ip", ("127.0.0.1", "localhost")), ("rdzv_backend", ("static", "c10d"))):
        if s.given(name) and s[name] not in used:  # accelerate writes rdzv_backend: static into every file
            s.notes.append(f"{name} ({s.sources[name]}) is ignored on one machine: the rendezvous binds to 127.0.0.1")
    if s.world_size == 1 and not s["max_restarts"]:
        for name in ("main_process_ip", "main_process_port", "rdzv_backend"):
            s.values[name], s.sources[name] = None, "derived: one process needs no rendezvous"
        if s["rdzv_timeout"]:
            s.notes.append(
                f"rdzv_timeout ({s.sources['rdzv_timeout']}) is ignored: one process without --max_restarts is "
                "started directly, with no rendezvous to wait for"
            )
        return
    loopback_rendezvous(s)


def loopback_rendezvous(s: Settings, why: str = "one machine") -> None:
    """torchrun's rendezvous on loopback, on a free port unless one was given (``why``: for the sources)."""
    s.values["main_process_ip"], s.sources["main_process_ip"] = "127.0.0.1", f"derived: {why}, loopback only"
    s.values["rdzv_backend"], s.sources["rdzv_backend"] = "c10d", f"derived: {why} (torchrun --standalone)"
    if s["main_process_port"] is None:
        s.values["main_process_port"], s.sources["main_process_port"] = 0, "derived: 0 = a free port, chosen at start"


def _derive_device(s: Settings) -> None:
    if s["cpu"]:
        s.values["device"], s.sources["device"] = "cpu", s.sources["cpu"]
    elif s.gpu_count:
        s.values["device"], s.sources["device"] = "cuda", f"derived: {s.gpu_count} CUDA GPU(s) visible"
    else:
        s.values["device"], s.sources["device"] = "cpu", "derived: no CUDA GPU on this machine"


def _derive_processes(s: Settings) -> None:
    machines, nproc, total = s["num_machines"], s["nproc_per_node"], s["num_processes"]
    if nproc is not None and total is not None:
        if nproc * machines != total:
            s.problems.append(
                f"num_processes {total} ({s.sources['num_processes']}) is the total over all machines, but "
                f"nproc_per_node {nproc} x {machines} machine(s) = {nproc * machines}; give only one of them"
            )
        return
    if nproc is not None:
        s.values["num_processes"] = nproc * machines
        s.sources["num_processes"] = f"derived: nproc_per_node {nproc} x {machines} machine(s)"
        return
    if total is not None:
        if total % machines:
            s.problems.append(
                f"num_processes {total} ({s.sources['num_processes']}) is the total over all machines and must "
                f"divide evenly by num_machines {machines}"
            )
        s.values["nproc_per_node"] = max(1, total // machines)
        s.sources["nproc_per_node"] = f"derived: num_processes {total} / {machines} machine(s)"
        return
    if s["device"] == "cuda":
        per_node, why = len(s.gpus), "derived: one process per GPU of this machine"
    else:
        per_node, why = 1, DEFAULT
    s.values["nproc_per_node"], s.sources["nproc_per_node"] = per_node, why
    s.values["num_processes"], s.sources["num_processes"] = per_node * machines, why


def _check(s: Settings) -> None:
    """Every problem that can be seen before a process starts (the launcher adds port and target checks)."""
    machines, rank = s["num_machines"], s["machine_rank"]
    if rank >= machines:
        s.problems.append(
            f"machine_rank {rank} ({s.sources['machine_rank']}) must be below num_machines {machines} "
            f"({s.sources['num_machines']}): machines are numbered 0 to {machines - 1}"
        )
    if machines > 1 and not s["main_process_ip"]:
        s.problems.append(
            f"{machines} machines need --main_process_ip: the address of machine 0 that every machine can "
            "reach (there is no default, so a job never waits for other machines on an address you did not choose)"
        )
    if machines > 1 and s["main_process_ip"] and _is_public(s["main_process_ip"]):
        s.notes.append(
            f"main_process_ip {s['main_process_ip']} is a public address: torch.distributed's rendezvous store has "
            "no authentication, so anyone who can reach it can join or disturb the job; use a private network"
        )
    if machines > 1 and s["rdzv_backend"] != "static" and s.given("machine_rank"):
        s.notes.append(
            f"machine_rank is not used by the {s['rdzv_backend']} rendezvous: it numbers the machines itself "
            "(use rdzv_backend static to fix each machine's rank)"
        )
    _check_gpus(s)
    _check_precision(s)
    _check_strategy(s)
    from trainer_ext.cli.launch.parallel import parallel_problems

    s.problems += parallel_problems(s)


def _is_public(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_global
    except ValueError:  # a host name: cannot tell without resolving it
        return False


def _check_gpus(s: Settings) -> None:
    wants_gpu = s["require_gpu"] or s.given("gpu_ids")
    if s["cpu"]:
        if s.given("gpu_ids"):
            s.notes.append(f"gpu_ids {s['gpu_ids']} is ignored: the processes run on the CPU")
        return
    asked = [s.sources["require_gpu"]] if s["require_gpu"] else []
    asked += [f"gpu_ids {s['gpu_ids']} from {s.sources['gpu_ids']}"] if s.given("gpu_ids") else []
    why = "; ".join(asked)
    if wants_gpu and s.gpu_count == 0:
        s.problems.append(
            f"GPUs are asked for ({why}) but this machine has no CUDA GPU that torch can use. Run CPU "
            "processes with --cpu (or distributed_type: MULTI_CPU), or run on a GPU machine"
        )
        return
    missing = [i for i in s.gpus if i >= s.gpu_count]
    if missing:
        s.problems.append(
            f"gpu_ids {s['gpu_ids']} ({s.sources['gpu_ids']}) names GPU(s) {', '.join(map(str, missing))} but "
            f"only {s.gpu_count} are visible (0 to {s.gpu_count - 1})"
        )
    elif s["device"] == "cuda" and s["nproc_per_node"] > len(s.gpus):
        s.problems.append(
            f"{s['nproc_per_node']} processes per machine ({s.sources['nproc_per_node']}) but only {len(s.gpus)} "
            "GPU(s) to use: each process needs its own GPU. Start fewer processes, or pass --cpu"
        )


def _check_precision(s: Settings) -> None:
    mode = s["mixed_precision"]
    if mode in ("fp16", "fp8") and s["device"] != "cuda":
        s.problems.append(
            f"mixed_precision {mode} ({s.sources['mixed_precision']}) needs a CUDA GPU, but the processes run on "
            f"the CPU ({s.sources['device']}). Use bf16 (supported on CPU) or no"
        )
    elif mode == "fp8":
        s.notes.append(
            "fp8 needs a GPU of compute capability >= 8.9 (e.g. H100) and torchao; each training process checks it"
        )


def _check_strategy(s: Settings) -> None:
    if s["deepspeed"] and s["fsdp_config"]:
        s.problems.append(
            f"both DeepSpeed ({s.sources['deepspeed']}) and FSDP ({s.sources['fsdp_config']}) are set; choose one"
        )
    for name in ("deepspeed", "fsdp_config"):
        path = s[name]
        if isinstance(path, str) and not os.path.isfile(os.path.expanduser(path)):
            s.problems.append(f"{name} file {path!r} ({s.sources[name]}) does not exist")
