"""CLI tests never read or write the real home directory or launch config, and see no GPU unless they say so."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_ext.cli.launch import settings as launch_settings


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HOME (so ~/.cache/trainer_ext is empty) and no launch variables from the outer environment."""
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("HOME", str(path))
    for name in (
        "TRAINER_EXT_CONFIG_FILE",
        "ACCELERATE_MIXED_PRECISION",
        "TRAINER_EXT_GRADIENT_ACCUMULATION_STEPS",
        "TRAINER_EXT_DEEPSPEED_CONFIG",
    ):
        monkeypatch.delenv(name, raising=False)
    return path


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """``gpus(n)``: pretend this machine has ``n`` CUDA GPUs (0 by default in these tests)."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(launch_settings, "visible_gpus", lambda: n)

    set_count(0)
    return set_count
