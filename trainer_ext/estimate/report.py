"""The estimate (and the measurement beside it) as text and as the ``--json`` document."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from trainer_ext.errors import ConfigError
from trainer_ext.estimate.breakdown import KEYS, Breakdown
from trainer_ext.estimate.setup import Setup
from trainer_ext.values import format_size

LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer": "optimizer states",
    "reference": "reference model",
    "activations": "activations",
    "total": "total",
}


def error_percent(estimated: float, measured: float) -> float | None:
    """(estimated - measured) / measured in percent; None when nothing was measured."""
    return None if not measured else 100.0 * (estimated - measured) / measured


def format_breakdown(
    breakdown: Breakdown, setup: Setup, measured: Mapping[str, int] | None = None, indent: str = ""
) -> str:
    """One line per key; with ``measured``, the measured bytes and the error beside each estimate."""
    est = breakdown.to_dict()
    lines = [f"{indent}{setup.describe()}"]
    header = f"{indent}{'':<34}{'estimated':>12}"
    if measured is not None:
        header += f"{'measured':>12}{'error':>9}"
    lines.append(header)
    for key in KEYS:
        if key == "reference" and not est[key] and not (measured or {}).get(key):
            continue  # no reference model (every job but full DPO)
        row = f"{indent}{LABELS[key]:<34}{format_size(est[key]):>12}"
        if measured is not None and key in measured:
            err = error_percent(est[key], measured[key])
            row += f"{format_size(measured[key]):>12}{'' if err is None else f'{err:+.1f}%':>9}"
        lines.append(row)
    other = "with" if not setup.checkpointing else "without"
    other_value = breakdown.activations_checkpointed if other == "with" else breakdown.activations_full
    lines.append(f"{indent}{'activations ' + other + ' checkpointing':<34}{format_size(other_value):>12}")
    lines.append(f"{indent}{'peak (+ transient buffers)':<34}{format_size(breakdown.peak):>12}")
    if breakdown.offloaded:
        lines.append(f"{indent}{'offloaded to CPU':<34}{format_size(breakdown.offloaded):>12}")
    if measured is not None and measured.get("cuda_peak"):
        lines.append(f"{indent}{'measured CUDA peak':<34}{'':>12}{format_size(measured['cuda_peak']):>12}")
    return "\n".join(lines)


def json_document(breakdown: Breakdown, setup: Setup, extra: Mapping[str, Any], measured: Mapping | None) -> dict:
    """``{"estimated": {...}, "measured": {...}}`` in bytes (``measured`` is null without --measure)."""
    estimated = breakdown.to_dict()
    return {
        "estimated": estimated,
        "measured": dict(measured) if measured is not None else None,
        "setup": {**setup.__dict__, **extra},
    }


def check_writable(path: str) -> None:
    """ConfigError unless ``path`` can be written: its folder exists and is writable, and it is not a folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"--json {path!r} is a folder; give a file name, e.g. {os.path.join(path, 'estimate.json')}")
    if not os.path.isdir(folder):
        raise ConfigError(f"--json {path!r}: the folder {folder!r} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--json {path!r}: the folder {folder!r} is not writable")
