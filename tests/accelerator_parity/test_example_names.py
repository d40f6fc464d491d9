"""Every name the vendored accelerate examples import from accelerate exists in trainer_ext (no accelerate needed).

The examples runner switches each top-level ``from accelerate[.utils|.logging|.local_sgd] import X`` line to
``from trainer_ext import X``; a name trainer_ext lacked failed there with an ImportError before the script ran.
"""

from __future__ import annotations

from pathlib import Path

import trainer_ext

from .examples.runner import switch_imports

UPSTREAM = Path(__file__).parent / "examples" / "upstream"


def _imported_names(source: str) -> set[str]:
    names: set[str] = set()
    for line in switch_imports(source)[1]:
        listed = line.split(" import ", 1)[1].strip().strip("()")
        names.update(part.split(" as ")[0].strip() for part in listed.split(",") if part.strip())
    return names


def test_every_name_the_vendored_examples_import_is_in_trainer_ext() -> None:
    scripts = sorted(UPSTREAM.rglob("*.py"))
    assert len(scripts) >= 15, f"expected the vendored examples under {UPSTREAM}"
    wanted = {name: script.name for script in scripts for name in _imported_names(script.read_text(encoding="utf-8"))}
    assert {"is_schedulefree_available", "is_npu_available", "is_xpu_available"} <= wanted.keys()
    missing = {name: where for name, where in wanted.items() if not hasattr(trainer_ext, name)}
    assert not missing, f"imported by the examples but not in trainer_ext: {missing}"
