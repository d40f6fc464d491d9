"""What ``trainer-ext launch`` runs: ``train``, a script or a module, with its own arguments."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field

from trainer_ext.errors import did_you_mean

USAGE = "trainer-ext launch [options] (SCRIPT.py | -m MODULE | train) [args...]"
SWAP_MODULE = "trainer_ext.cli.launch.swap"  # runs a script with transformers' Trainer classes swapped for ours
COMMANDS = ("train",)  # the words launch runs itself; any other word is a script path


@dataclass
class Target:
    """What to run: ``train`` (``python -m trainer_ext train``), a script, or a module, with its arguments.

    ``swap``: a script or module runs through :mod:`.swap`, with transformers' ``Trainer`` classes replaced by ours.
    """

    kind: str
    name: str
    args: list[str] = field(default_factory=list)
    swap: bool = False

    def python_argv(self) -> list[str]:
        if self.kind == "train":
            return ["-m", "trainer_ext", "train", *self.args]
        own = [self.name, *self.args] if self.kind == "script" else ["-m", self.name, *self.args]
        return ["-m", SWAP_MODULE, *own] if self.swap else own


def target_problems(target: Target | None) -> list[str]:
    """A missing script (or, to swap in our Trainer, not a .py file) or an unimportable module, found before any
    process starts."""
    if target is None:
        return [f"nothing to launch: give SCRIPT.py, -m MODULE or train ({USAGE})"]
    if target.kind == "script" and not os.path.isfile(target.name):
        return [_missing_script(target.name)]
    if target.kind == "script" and target.swap and not target.name.endswith(".py"):
        return [f"script {target.name!r} is not a .py file: --swap_trainer runs a Python script (or -m MODULE)"]
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


def _missing_script(name: str) -> str:
    """A script that is not there; a bare word close to a command (``trian``) is named as the misspelt command."""
    hint = did_you_mean(name, COMMANDS) if os.sep not in name and "." not in name else ""
    if hint:
        return (
            f"{name!r} is neither a script (no such file in {os.getcwd()}) nor a command ({', '.join(COMMANDS)})."
            f"{hint}"
        )
    return f"script {name!r} not found (working directory {os.getcwd()})"
