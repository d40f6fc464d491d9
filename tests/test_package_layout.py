"""The package tree is the map: concepts one hop from the top, and each package imports only the layers below it.

A newcomer reads ``trainer_ext/`` as CLI -> job -> Trainer/Accelerator -> engine and strategies -> checkpoint I/O ->
leaf helpers. These checks read the source (``ast``), lazy imports included, so a new module lands in a package and
a new import goes downwards, or this test names the file and the line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trainer_ext"

# the only modules at the top: small helpers anyone may import (they import nothing of ours but errors)
LEAVES = {"errors", "values", "config_files", "env_vars", "field_types"}
TOP_FILES = {"__init__", "__main__", *LEAVES}

# package -> the packages it may import (besides itself and the leaves); read top to bottom, the layers go down
ALLOWED = {
    "checkpointing": set(),
    "distributed": {"checkpointing"},
    "inference": {"distributed"},
    "metrics": set(),
    "trackers": set(),
    "callbacks": {"distributed", "checkpointing"},
    "trainer": {"callbacks", "distributed", "checkpointing", "metrics", "trackers"},
    "accelerator": {"distributed", "checkpointing", "trackers"},
    "report": {"callbacks", "checkpointing"},
    # chat data, templates, packing and the preference trainer: the sft and dpo jobs' pieces
    "chat": {"trainer"},
    # estimate builds and runs the job to measure it; the job runs estimate's start-up memory check (lazily)
    "estimate": {"distributed", "job"},
    # plan ranks layouts with the estimator's memory and runs the job to verify them
    "plan": {"distributed", "estimate", "job"},
    "job": {"chat", "trainer", "callbacks", "checkpointing", "distributed", "estimate", "metrics", "report"},
    "cli": {
        "job",
        "trainer",
        "accelerator",
        "estimate",
        "plan",
        "report",
        "checkpointing",
        "distributed",
        "inference",
    },
}


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level unit under trainer_ext) for every import of ours in ``path``, lazy and typing-only ones too."""
    package = list(path.relative_to(PACKAGE.parent).parts[:-1])
    return _imported_units(path.read_text(encoding="utf-8"), package)


def _imported_units(text: str, package: list[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target == "trainer_ext":  # from trainer_ext import env_vars: the names are the modules
                found += [(node.lineno, alias.name) for alias in node.names if not alias.name.startswith("__")]
            elif target.startswith("trainer_ext."):
                found.append((node.lineno, _package_of(target)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, _package_of(a.name)) for a in node.names if a.name.startswith("trainer_ext.")]
    return found


def test_no_loose_module_at_the_top() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.stem not in TOP_FILES)
    assert loose == [], f"put these in the package of their concept (or list a true leaf in LEAVES): {loose}"


def test_every_folder_is_a_known_package() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == set(ALLOWED), "a new package needs its row in ALLOWED (what it may import)"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    allowed = ALLOWED[package] | LEAVES | {package}
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports trainer_ext.{unit}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for line, unit in _imported_packages(path)
        if unit not in allowed
    ]
    assert bad == []


def test_leaves_import_only_errors() -> None:
    bad = [
        f"{name}.py:{line} imports trainer_ext.{unit}"
        for name in sorted(LEAVES)
        for line, unit in _imported_packages(PACKAGE / f"{name}.py")
        if unit not in {"errors", name}
    ]
    assert bad == []


def test_the_check_sees_an_upward_import() -> None:
    """A lazy import of the Trainer from a strategy is reported as a Trainer import; relative imports resolve."""
    text = "def f():\n    from trainer_ext.trainer.trainer import Trainer\n    from ... import values\n"
    found = _imported_units(text, ["trainer_ext", "distributed", "strategies"])
    assert found == [(2, "trainer"), (3, "values")]
    assert "trainer" not in ALLOWED["distributed"]


def test_every_module_is_small() -> None:
    """Modules stay single-purpose: 500 lines at most (split by concept before adding the 501st)."""
    long = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > 500
    }
    assert long == {}
