"""The test tree is one package that shadows nothing.

Helpers import as ``tests.helpers.*`` and rank jobs start as ``python -m tests.…``; no folder of the tree is put on
``sys.path``. A folder named like an installed package (``tests/deepspeed`` once made ``import deepspeed`` find
the test folder instead of DeepSpeed) is refused even so, in every environment: the names are looked up in a
fresh interpreter without the repository on its path, and the import names of our optional extras are refused
whether or not they are installed here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT

TESTS = ROOT / "tests"
OURS = {"trainer_ext", "tests"}  # our own top-level packages (trainer_ext: the editable install)
# the import names of the optional extras (setup.cfg) and of what CI's other environments add: refused even where
# they are not installed, since a folder of that name would shadow them where they are
EXTRAS = {"deepspeed", "peft", "accelerate", "torchao", "tensorboard", "wandb", "mlflow", "trackio"}

_FIND = """
import importlib.util, json, sys
found = {}
for name in sys.argv[1:]:
    spec = importlib.util.find_spec(name)
    if spec is not None:
        found[name] = spec.origin or ", ".join(spec.submodule_search_locations or [])
print(json.dumps(found))
"""


def _folders() -> list[Path]:
    return sorted(
        path
        for path in TESTS.rglob("*")
        if path.is_dir() and path.name != "__pycache__" and not any(part.startswith(".") for part in path.parts)
    )


def _importable_elsewhere(names: list[str], cwd: Path) -> dict[str, str]:
    """``{name: where}`` for the names, other than our own packages, that a fresh interpreter can import.

    ``-I``: no PYTHONPATH, no user site; run from an empty folder, so neither the repository root nor tests/ is
    on its path: what it finds is installed.
    """
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _FIND, *names], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    return {name: where for name, where in found.items() if name not in OURS}


def test_no_test_folder_has_the_name_of_an_importable_module(tmp_path: Path) -> None:
    names = sorted({folder.name for folder in _folders()})
    clashes = _importable_elsewhere(names, tmp_path)
    for name in EXTRAS.intersection(names):
        clashes.setdefault(name, "an optional extra of trainer_ext, not installed here")
    assert not clashes, (
        "test folders named like importable modules (name them after what they test, e.g. tests/distributed/strategies): "
        + "; ".join(f"{name} ({where})" for name, where in sorted(clashes.items()))
    )


def test_the_check_sees_installed_packages(tmp_path: Path) -> None:
    """The look-up itself works: ``json`` and ``pytest`` are importable, a made-up name and tests/' folders are not."""
    found = _importable_elsewhere(["json", "pytest", "no_such_module_here", "helpers", "strategies"], tmp_path)
    assert set(found) == {"json", "pytest"}


def test_every_test_folder_is_a_package() -> None:
    """pytest puts a test folder without ``__init__.py`` on sys.path (import mode "prepend"): none may lack one."""
    missing = [str(folder.relative_to(ROOT)) for folder in _folders() if not (folder / "__init__.py").is_file()]
    assert not missing, f"add an __init__.py to: {', '.join(missing)}"


def test_no_test_code_edits_sys_path() -> None:
    """Helpers and jobs import by package path; a child process gets the repository root on PYTHONPATH instead."""
    edit = re.compile(r"sys\.path\s*(\[[^\]]*\]\s*=|=|\.(insert|append|extend)\b)")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted(TESTS.rglob("*.py"))
        if path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if edit.search(line)
    ]
    assert not offenders, f"sys.path edited in: {', '.join(offenders)}"
