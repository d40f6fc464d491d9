"""What every scenario process does first, whichever set it belongs to: hide accelerate from ours, run quietly and
deterministically on the CPU, stop with its launcher, and say which versions it ran.

``ours`` hides accelerate from the import system, as where it is not installed (transformers then sees no accelerate,
and trainer_ext importing it would fail the scenario); peft is hidden with it: peft imports accelerate, so an
environment without accelerate has no peft either (and transformers, seeing peft, would import it).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

# Hidden from ``ours``: accelerate, and the packages that cannot be installed without it (peft imports it).
HIDDEN = ("accelerate", "peft")


class _HideAccelerate(importlib.machinery.PathFinder):
    """The path finder, blind to ``HIDDEN`` (``find_spec`` answers None, as when they are not installed)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in HIDDEN:
            return None
        return super().find_spec(fullname, path, target)


def hide_accelerate() -> None:
    """From now on this process imports neither accelerate nor peft, as where they are not installed."""
    sys.meta_path[:] = [_HideAccelerate if f is importlib.machinery.PathFinder else f for f in sys.meta_path]


def quiet_and_deterministic() -> None:
    """One CPU thread (the same reductions in both processes), no GPU, no hub, no progress bars."""
    for name, value in {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "WANDB_MODE": "disabled",
    }.items():
        os.environ[name] = value


def set_up(impl: str) -> None:
    """A scenario process's first step: accelerate hidden where ``impl`` is ``ours``, then quiet and deterministic."""
    if impl == "ours":
        hide_accelerate()
    quiet_and_deterministic()


def die_with_launcher() -> None:
    """A rank whose launcher is gone (killed after a hang) exits instead of waiting on its peers forever."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def leave_without_teardown() -> None:
    """End a stock rank now that everything is recorded, skipping the interpreter's teardown.

    accelerate leaves torch's gloo group to interpreter teardown, where a worker thread still holding work aborts the
    process now and then ("terminate called without an active exception", SIGABRT while garbage-collecting: 1 phase
    in 8 measured on 2 processes). trainer_ext tears its group down itself (atexit), so ours exits normally and an
    abort there still fails the phase.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def versions(packages: tuple[str, ...]) -> dict[str, str | None]:
    """The installed version of each package (None where it is not installed)."""
    found: dict[str, str | None] = {}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def files_under(root: Path | str) -> list[str]:
    """Every file under ``root`` (recursively, ``__pycache__`` left out), as sorted relative paths: what a run left on
    disk (``[]`` where ``root`` does not exist)."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
