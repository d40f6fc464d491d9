"""accelerate.utils' ``is_*_available`` checks, exported lazily by trainer_ext: truthful here, cheap to ask.

Their answers are compared with accelerate's in tests/accelerator_parity/test_utility_names.py (side environment).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainer_ext
from trainer_ext.accelerator import availability

PACKAGE_CHECKS = {
    "is_deepspeed_available": "deepspeed",
    "is_wandb_available": "wandb",
    "is_datasets_available": "datasets",
    "is_transformers_available": "transformers",
    "is_pandas_available": "pandas",
    "is_matplotlib_available": "matplotlib",
    "is_tensorboard_available": "tensorboard",
    "is_mlflow_available": "mlflow",
}


def test_trainer_ext_exports_every_check() -> None:
    exported = {name for name in trainer_ext.__all__ if name.startswith("is_")}
    assert exported == set(availability.__all__)
    assert all(getattr(trainer_ext, name) is getattr(availability, name) for name in availability.__all__)
    assert {"is_schedulefree_available", "is_npu_available", "is_xpu_available"} <= exported


def test_answers_are_what_this_environment_has() -> None:
    for name in availability.__all__:
        if name != "is_torch_version":
            assert isinstance(getattr(availability, name)(), bool), name
    for name, module in PACKAGE_CHECKS.items():
        assert getattr(availability, name)() == (importlib.util.find_spec(module) is not None), name
    assert availability.is_cuda_available() == torch.cuda.is_available()
    assert availability.is_bf16_available() == (not torch.cuda.is_available() or torch.cuda.is_bf16_supported())
    assert availability.is_torch_version(">=", "2.0") and not availability.is_torch_version("<", "2.0")
    assert availability.is_weights_only_available()
    with pytest.raises(ValueError, match="operation must be one of"):
        availability.is_torch_version("=>", "2.0")


def test_a_stray_folder_of_a_packages_name_is_not_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "schedulefree").mkdir()
    (tmp_path / "schedulefree" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("schedulefree") is not None
    assert availability.is_schedulefree_available() is False  # importable, but no distribution installed it


def test_asking_imports_none_of_the_packages_asked_about() -> None:
    code = (
        "import json, sys, trainer_ext\n"
        f"names = {sorted(PACKAGE_CHECKS)!r}\n"
        "answers = {n: getattr(trainer_ext, n)() for n in names}\n"
        f"print(json.dumps([m for m in {sorted(set(PACKAGE_CHECKS.values()))!r} if m in sys.modules]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
