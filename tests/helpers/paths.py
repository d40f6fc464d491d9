"""Where the repository's files are, for tests that read its configs or start its scripts and modules."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root: `python -m tests.…` works from here
CONFIGS = ROOT / "configs"
