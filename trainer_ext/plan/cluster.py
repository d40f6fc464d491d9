"""The machines a plan is for: how many, devices on each, their memory and speed, and the links between them.

Link speeds are the bytes one device sends per second in one direction, conservative effective figures (not the
data sheets' peaks); a dimension's collectives run at the speed of the slowest link its process group spans: within
a machine when all its ranks sit on one machine, else between machines. Device speed is the FLOP/s one device
sustains in training (about 40 % of an H100's dense peak under bf16/fp16, 10 % under fp32 without TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer_ext.errors import ConfigError

# bytes per second one device sends over the link (per direction, effective)
INTERCONNECTS = {
    "nvlink": 300e9,  # NVLink 4 / NVSwitch (H100 SXM: 450 GB/s per direction at peak)
    "pcie": 25e9,  # PCIe 4.0 x16 through the host
    "ib": 25e9,  # one 200 Gb/s InfiniBand (or RoCE) adapter per device
    "roce": 25e9,
    "efa": 12.5e9,  # AWS EFA, 100 Gb/s per device
    "ethernet": 3e9,  # 25 GbE shared by the machine
    "shm": 10e9,  # CPU processes on one machine (gloo over shared memory / loopback)
}
DEVICE_FLOPS = {"bf16": 4e14, "fp16": 4e14, "no": 5e13}
CPU_FLOPS = 5e10  # one CPU process, one thread


@dataclass(frozen=True)
class Cluster:
    """``num_machines`` × ``per_machine`` devices of ``device_memory`` bytes each (0: no limit, a CPU machine)."""

    num_machines: int = 1
    per_machine: int = 1
    device_memory: int = 0
    intra: str = "nvlink"  # the link within a machine
    inter: str = "ib"  # the link between machines
    device: str = "cuda"  # cuda | cpu: which speeds apply
    host_memory: int = 0  # bytes of host memory per machine for CPU offload (0: not checked)

    @property
    def world(self) -> int:
        return self.num_machines * self.per_machine

    def flops(self, precision: str) -> float:
        """FLOP/s one device sustains in training at ``precision`` (no | bf16 | fp16)."""
        return CPU_FLOPS if self.device == "cpu" else DEVICE_FLOPS.get(precision, DEVICE_FLOPS["no"])

    def spans_machines(self, stride: int, size: int) -> bool:
        """Whether a process group of ``size`` ranks ``stride`` apart (a mesh dimension) spans machines."""
        return size > 1 and self.num_machines > 1 and stride * size > self.per_machine

    def link(self, stride: int, size: int) -> str:
        """The link a group of ``size`` ranks ``stride`` apart runs over."""
        return self.inter if self.spans_machines(stride, size) else self.intra

    def bandwidth(self, link: str) -> float:
        return INTERCONNECTS[link]

    def describe(self) -> str:
        memory = f" of {_size(self.device_memory)}" if self.device_memory else ""
        memory += f", {_size(self.host_memory)} host memory per machine" if self.host_memory else ""
        kind = "CPU process" if self.device == "cpu" else "device"
        links = self.intra if self.num_machines == 1 else f"{self.intra} within, {self.inter} between machines"
        many = ("es" if self.device == "cpu" else "s") if self.per_machine > 1 else ""
        if self.num_machines == 1:
            return f"{self.per_machine} {kind}{many}{memory} ({links})"
        return f"{self.num_machines} machines × {self.per_machine} {kind}{many}{memory} ({links})"


def _size(value: int) -> str:
    from trainer_ext.values import format_size

    return format_size(value)


def parse_interconnect(text: str | None, num_machines: int, device: str = "cuda") -> tuple[str, str]:
    """(within, between) machines from ``--interconnect``: ``nvlink,ib`` names both; one name is the link between
    machines when there are several (within: nvlink), else the link within the one machine. Defaults: nvlink within
    (shm for CPU processes), ib between."""
    within = "shm" if device == "cpu" else "nvlink"
    if not text:
        return within, "ib"
    names = [part.strip().lower() for part in str(text).split(",") if part.strip()]
    unknown = [name for name in names if name not in INTERCONNECTS]
    if unknown or not 1 <= len(names) <= 2:
        raise ConfigError(
            f"--interconnect {text!r}: give one link or 'within,between' from {', '.join(INTERCONNECTS)} "
            "(e.g. --interconnect nvlink,ib)"
        )
    if len(names) == 2:
        return names[0], names[1]
    return (within, names[0]) if num_machines > 1 else (names[0], "ib")
