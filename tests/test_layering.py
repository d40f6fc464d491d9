"""The package's layers import downwards only, and generic code never names a backend.

CLI -> job API -> Trainer/Accelerator -> engine -> strategies -> checkpoint I/O and leaf modules. Read from the
source (``ast``), so a violation fails here with the file and the line, before it becomes an import cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trainer_ext"

# leaf modules: anyone may import them, they import nothing of ours but errors.py
LEAVES = {"errors", "values", "config_files", "env_vars"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of a trainer_ext module in ``path``, lazy ones included."""
    return _imports_of(path.read_text(encoding="utf-8"), _module_name(path), path.name == "__init__.py")


def _imports_of(text: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    tree = ast.parse(text)
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            found += [(node.lineno, n) for n in names if n.startswith("trainer_ext")]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("trainer_ext")]
    return found


def _sources(*folders: str) -> list[Path]:
    out: list[Path] = []
    for folder in folders:
        target = PACKAGE / folder
        out += [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))
    return out


def _violations(files: list[Path], allowed: tuple[str, ...]) -> list[str]:
    bad = []
    for path in files:
        own = _module_name(path)
        for line, name in _imports(path):
            inside = name == own or name.startswith(own.rsplit(".", 1)[0] + ".") and own.count(".") > 1
            if inside or any(name == a or name.startswith(a + ".") for a in allowed):
                continue
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return bad


def test_leaf_modules_import_only_errors() -> None:
    files = [PACKAGE / f"{name}.py" for name in sorted(LEAVES)]
    assert _violations(files, ("trainer_ext.errors",)) == []


def test_checkpoint_io_sits_below_the_engine() -> None:
    """checkpointing/ (commit markers, verification, sharded files) never imports the engine or anything above.

    ``_compat`` (transformers' internals, beside the layers) lends it transformers' RNG allow-list, lazily.
    """
    allowed = (
        "trainer_ext.checkpointing",
        "trainer_ext.saving",
        "trainer_ext._compat",
        *(f"trainer_ext.{m}" for m in LEAVES),
    )
    assert _violations(_sources("checkpointing"), allowed) == []


def test_distributed_imports_nothing_above_it() -> None:
    allowed = (
        "trainer_ext.distributed",
        "trainer_ext.checkpointing",
        "trainer_ext.saving",
        *(f"trainer_ext.{m}" for m in LEAVES),
    )
    assert _violations(_sources("distributed"), allowed) == []


def test_only_the_entry_point_imports_the_cli() -> None:
    outside = [p for p in PACKAGE.rglob("*.py") if "cli" not in p.relative_to(PACKAGE).parts]
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path in outside
        if path.name != "__main__.py"
        for line, name in _imports(path)
        if name.startswith("trainer_ext.cli")
    ]
    assert bad == []


# generic code: it calls the strategy interface and never asks which backend it is
GENERIC = ("distributed/engine.py", "accelerator.py", "trainer.py", "trainer_sharded.py", "trainer_checkpoints.py")
BACKEND_WORDS = ("hf_config", "is_engine", "is_sharded", "strategy.engine", "is_zero3", "DeepSpeedStrategy")


@pytest.mark.parametrize("relative", GENERIC)
def test_generic_code_never_names_a_backend(relative: str) -> None:
    path = PACKAGE / relative
    backend_imports = [
        f"{relative}:{line} imports {name}"
        for line, name in _imports(path)
        if name.startswith(("trainer_ext.distributed.strategies.", "trainer_ext.distributed.deepspeed_config"))
    ]
    words = [
        f"{relative}:{number} reads {word!r}"
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        for word in BACKEND_WORDS
        if re.search(rf"\b{re.escape(word)}\b", text)
    ]
    assert backend_imports + words == []


def test_the_checks_see_a_violation() -> None:
    """The import reader resolves relative imports, lazy ones too: a leaf importing the engine is reported."""
    text = "def f():\n    from .distributed.engine import Engine\n    from . import saving\n"
    assert _imports_of(text, "trainer_ext.values", is_package=False) == [
        (2, "trainer_ext.distributed.engine"),
        (3, "trainer_ext.saving"),
    ]
    assert _imports_of("from ..state import X\n", "trainer_ext.distributed.strategies", is_package=True) == [
        (1, "trainer_ext.distributed.state")
    ]
