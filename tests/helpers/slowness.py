"""Time limits in tests are hang guards, never speed checks: each is scaled to how busy the machine is.

``SCALE`` is ``TRAINER_EXT_TIMEOUT_SCALE`` when set, else 3 on a quiet machine and more under load (3 x the runnable
processes per usable core at session start, load average included). conftest applies it to every
``pytest.mark.timeout`` and to the ``timeout=`` of ``subprocess.run``; a helper with its own clock calls ``scaled``.
"""

from __future__ import annotations

import os

BASE = 3.0


def _scale() -> float:
    given = os.environ.get("TRAINER_EXT_TIMEOUT_SCALE")
    if given:
        return max(float(given), 0.01)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return BASE * max(1.0, (load + 1) / cores)


SCALE = _scale()


def scaled(seconds: float) -> float:
    """``seconds`` stretched by SCALE."""
    return seconds * SCALE
