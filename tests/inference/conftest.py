"""Fixtures for the dispatch tests: the test model saved as checkpoints, shared by the session."""

from __future__ import annotations

import pytest

from tests.inference.dispatch_models import make_llama


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The tied Llama saved by save_pretrained: as one file and sharded into 50 KB files."""
    model = make_llama()
    root = tmp_path_factory.mktemp("checkpoints")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="50KB")
    return {"single": root / "single", "sharded": root / "sharded", "model": model}
