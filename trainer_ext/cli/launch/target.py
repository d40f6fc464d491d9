"""What ``trainer-ext launch`` runs: ``train``, a script or a module, with its own arguments."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field

USAGE = "trainer-ext launch [options] (SCRIPT.py | -m MODULE | train) [args...]"


@dataclass
class Target:
    """What to run: ``train`` (``python -m trainer_ext train``), a script, or a module, with its arguments."""

    kind: str
    name: str
    args: list[str] = field(default_factory=list)

    def python_argv(self) -> list[str]:
        if self.kind == "script":
            return [self.name, *self.args]
        if self.kind == "train":
            return ["-m", "trainer_ext", "train", *self.args]
        return ["-m", self.name, *self.args]


def target_problems(target: Target | None) -> list[str]:
    """A missing script or an unimportable module, found before any process starts."""
    if target is None:
        return [f"nothing to launch: give SCRIPT.py, -m MODULE or train ({USAGE})"]
    if target.kind == "script" and not os.path.isfile(target.name):
        return [f"script {target.name!r} not found (working directory {os.getcwd()})"]
    if target.kind == "module":
        sys.path.insert(0, os.getcwd())  # `python -m` in the processes finds modules in the working directory
        try:
            found = importlib.util.find_spec(target.name) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            return [f"module {target.name!r} not found: `python -m {target.name}` would fail (is it installed?)"]
    return []
