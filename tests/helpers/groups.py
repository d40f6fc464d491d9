"""Tear down a group of one that flags parsed in the test process started (``--fsdp`` sets up the device, and with
it a process group of one), so that later tests in the same process see no process group and no launcher variables."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def no_group_left() -> Iterator[None]:
    """After the test, destroy the process group it left behind (and put back the variables its state set)."""
    had = dist.is_available() and dist.is_initialized()
    yield
    if had or not (dist.is_available() and dist.is_initialized()):
        return
    from trainer_ext.distributed.state import DistState

    for state in [obj for obj in gc.get_objects() if isinstance(obj, DistState)]:
        if state.owns_process_group:
            state.destroy()
    assert not dist.is_initialized(), "a process group outlived the test and no trainer_ext state owned it"
