"""Import cost: ``import trainer_ext`` loads none of the heavy optional parts (issue #10's import rule)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("deepspeed", "peft", "accelerate", "wandb", "mlflow", "trackio", "tensorboard", "torchao")


def _modules_after(statement: str) -> set[str]:
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def _loaded(modules: set[str], roots: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in roots)


def test_import_trainer_ext_loads_nothing_heavy() -> None:
    modules = _modules_after("import trainer_ext")
    assert _loaded(modules, HEAVY) == []
    assert "transformers" not in modules  # names load lazily: the package itself costs milliseconds
    assert not [m for m in modules if m.startswith("trainer_ext.cli")]


def test_the_trainer_loads_no_optional_dependency() -> None:
    modules = _modules_after("from trainer_ext import Trainer, TrainingArguments, Accelerator")
    assert _loaded(modules, HEAVY) == []
    assert not [m for m in modules if m.startswith("trainer_ext.cli")]
