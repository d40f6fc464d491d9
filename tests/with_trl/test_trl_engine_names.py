"""Every name TRL's source reads from ``trainer.accelerator`` exists on our engine (see tests/test_engine_names.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from tests.test_engine_names import missing_names, reads  # noqa: E402


def test_every_name_trl_reads_from_the_engine_exists() -> None:
    missing = missing_names("trl")
    assert not missing, "names TRL reads from trainer.accelerator that the engine lacks:\n" + "\n".join(missing)


def test_the_scan_finds_what_trl_scripts_call() -> None:
    found = reads("trl")
    for name in ("print", "dataloader_config", "split_between_processes", "gather_for_metrics"):
        assert ("accelerator", name) in found, name
