"""The device the fast suite's device-sensitive tests build on: ``TRAINER_EXT_TEST_DEVICE`` is ``cpu`` (the default)
or ``cuda`` (the GPU kit's CUDA pass, ``benchmarks/gpu_kit/tests_step.py``); any other value is an error."""

from __future__ import annotations

import os
from collections.abc import Mapping

VARIABLE = "TRAINER_EXT_TEST_DEVICE"
DEVICES = ("cpu", "cuda")


def chosen_device(environ: Mapping[str, str] | None = None) -> str:
    """``cpu`` or ``cuda`` from ``TRAINER_EXT_TEST_DEVICE`` (unset or empty: ``cpu``); ValueError for anything else."""
    value = (os.environ if environ is None else environ).get(VARIABLE, "").strip()
    if value == "":
        return "cpu"
    if value not in DEVICES:
        raise ValueError(f"{VARIABLE}={value!r} is not a test device: set it to 'cpu' (the default) or 'cuda'")
    return value


def use_cpu(environ: Mapping[str, str] | None = None) -> bool:
    """What the chosen tests pass as ``use_cpu``/``Accelerator(cpu=...)``: True unless the switch says ``cuda``."""
    return chosen_device(environ) == "cpu"


def switch_problem(environ: Mapping[str, str] | None = None) -> str | None:
    """Why the test session cannot run as the switch asks (a bad value, ``cuda`` without a GPU), or None."""
    try:
        device = chosen_device(environ)
    except ValueError as exc:
        return str(exc)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return f"{VARIABLE}=cuda but torch sees no CUDA GPU here; unset it (or set it to 'cpu') to test on the CPU"
    return None
