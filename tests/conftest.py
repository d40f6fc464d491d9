"""Shared pytest set-up: no environment leaks between tests; tests that need CUDA or an extra skip without it.

Helpers import as ``tests.helpers.*`` (the repository root is on sys.path through pytest's ``pythonpath``); no
folder of this package is ever put on sys.path, so none can shadow an installed package.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers.device import switch_problem
from tests.helpers.slowness import SCALE, scaled

# One CPU thread per process unless the caller chose (tests start several processes on 2 cores; torch's default of
# every core with spinning OpenMP threads made a loaded machine 14x slower); set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# marker -> (the module its tests need, how to install it). They are skipped where it is not installed; under
# TRAINER_EXT_REQUIRE_<MODULE>=1 (CI's DeepSpeed step) a module that does not import stops the run instead, since
# a suite skipped whole would pass silently.
EXTRAS = {"deepspeed": ("deepspeed", "DS_BUILD_OPS=0 pip install -e '.[deepspeed]'")}


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test never sees launcher variables unless it sets them itself."""
    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_COMM_WORLD")):
            monkeypatch.delenv(name, raising=False)


def _scaling(method):
    def scaled_method(self, *args, timeout=None, **kwargs):
        return method(self, *args, timeout=None if timeout is None else scaled(timeout), **kwargs)

    scaled_method.__wrapped__ = method
    return scaled_method


def pytest_configure(config: pytest.Config) -> None:
    """A subprocess's ``timeout=`` in tests and helpers (``run``, ``communicate``, ``wait``) is a hang guard: scaled
    like the timeout markers (``subprocess.run`` waits through ``communicate``). A bad ``TRAINER_EXT_TEST_DEVICE``
    stops the session: it never runs on the CPU in silence."""
    problem = switch_problem()
    if problem is not None:
        pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)
    for name in ("communicate", "wait"):
        method = getattr(subprocess.Popen, name)
        if not hasattr(method, "__wrapped__"):
            setattr(subprocess.Popen, name, _scaling(method))


def pytest_report_header(config: pytest.Config) -> str:
    return f"trainer_ext: time limits x{SCALE:.1f} (TRAINER_EXT_TIMEOUT_SCALE), OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Timeout markers scaled (hang guards, not speed checks); GPU tests run only where CUDA is present; a test
    marked with an extra runs only where it is installed."""
    import torch

    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is not None and (marker.args or "timeout" in marker.kwargs):
            kwargs = dict(marker.kwargs)
            seconds = float(marker.args[0] if marker.args else kwargs.pop("timeout"))
            item.add_marker(pytest.mark.timeout(scaled(seconds), **kwargs), append=False)

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (run on the lent GPU machine)")
        for item in items:
            if item.get_closest_marker("gpu") is not None:  # the marker, not a parameter id that reads "gpu"
                item.add_marker(skip)
    for marker, (module, install) in EXTRAS.items():
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        if marked and _missing(module, install):
            skip = pytest.mark.skip(reason=f"needs {module}, which is not installed: {install}")
            for item in marked:
                item.add_marker(skip)


def _missing(module: str, install: str) -> bool:
    """Not installed (a cheap look-up); under TRAINER_EXT_REQUIRE_<MODULE>=1 it must import, or the run stops.

    The import is tried in a child process: importing DeepSpeed here would change this process for every test.
    """
    required = f"TRAINER_EXT_REQUIRE_{module.upper()}"
    if os.environ.get(required) != "1":
        return importlib.util.find_spec(module) is None
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.exit(f"{required}=1 but {module} does not import ({error}); install the extra: {install}", returncode=1)
    return False
