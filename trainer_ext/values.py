"""The one reader of typed words from flags and config files: booleans and byte sizes (and sizes for humans).

Sizes follow huggingface_hub and transformers (``max_shard_size="5GB"``): ``KB/MB/GB/TB`` are powers of
10 and ``KiB/MiB/GiB/TiB`` powers of 2, in any case (``"10 kb"`` is 10_000 bytes, never bits). A bare
``K/M/G/T`` ("2G") is refused: Slurm's ``--mem=2G`` means 2 GiB, Kubernetes' ``2G`` means 2*10**9 bytes, and
transformers and accelerate refuse it too, so the message asks for one of the two explicit spellings. The
Kubernetes spellings ``Ki/Mi/Gi/Ti`` are unambiguous and mean the binary units.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from trainer_ext.errors import ConfigError, did_you_mean

TRUE_WORDS = ("true", "yes", "on", "1", "y", "t")
FALSE_WORDS = ("false", "no", "off", "0", "n", "f")
# the mixed-precision modes, as accelerate spells them (launch config files, --mixed_precision, the engine)
MIXED_PRECISION = ("no", "bf16", "fp16", "fp8")

UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_bool(value: Any, name: str | None = None) -> bool:
    """A bool from a YAML value or a typed word: true/yes/on/1/y/t or false/no/off/0/n/f (any case).

    Anything else is a ConfigError (a ValueError): "NAME must be true or false, got 'maybe'" with ``name``,
    "'maybe' is not true or false" without.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    if name:
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    raise ConfigError(f"{value!r} is not true or false")


def is_true(value: Any) -> bool:
    """True for a value :func:`parse_bool` reads as true; False for false, None and words it cannot read."""
    try:
        return value is not None and parse_bool(value)
    except ConfigError:
        return False


def parse_size(value: int | float | str, what: str = "size") -> int:
    """Bytes from ``1024``, ``"2MB"`` (2*10**6), ``"2MiB"`` (2*2**20), ``"1.5GB"``; a ConfigError otherwise.

    ``what`` names the value in the message ("memory size", "shard size").
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what} {value!r} is not a size; write bytes or a string like '2GB' or '512MiB'")
    if isinstance(value, int | float):
        if value < 0:
            raise ConfigError(f"{what} {value!r} is negative")
        return int(value)
    match = _SIZE.match(str(value))
    unit = match.group(2).upper() if match else None
    if unit in ("K", "M", "G", "T"):
        number = match.group(1)
        raise ConfigError(
            f"cannot read the {what} {value!r}: {match.group(2)!r} is ambiguous; write '{number}{unit}B' "
            f"({number}*10**{3 * ('KMGT'.index(unit) + 1)} bytes) or '{number}{unit}iB' "
            f"({number}*2**{10 * ('KMGT'.index(unit) + 1)} bytes)"
        )
    if unit is not None and unit not in UNITS and unit + "B" in UNITS:
        unit += "B"  # "512Mi"
    if match is None or unit not in UNITS:
        raise ConfigError(
            f"cannot read the {what} {value!r}; write bytes (an int) or a string like '2GB', '512MiB', '10KB'"
        )
    return int(float(match.group(1)) * UNITS[unit])


def format_size(nbytes: float) -> str:
    """A short human size: ``512 B``, ``2.0 KiB``, ``1.50 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}" if scale == 2**30 else f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def normalize_keys(values: Mapping[str, Any], valid: Iterable[str], source: str) -> dict[str, Any]:
    """Map ``a-b`` keys to ``a_b``; ConfigError naming any unknown key and the closest valid ones."""
    valid = list(valid)
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in valid:
            raise ConfigError(f"unknown key {key!r} in {source}.{did_you_mean(name, valid)}")
        out[name] = value
    return out
