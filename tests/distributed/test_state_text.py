"""``print(accelerator.state)``: accelerate's summary lines with our values; ``repr`` stays the short one.

The text is compared with stock accelerate's on 1 and 2 processes in
tests/accelerator_parity/test_utility_names.py (side environment).
"""

from __future__ import annotations

from trainer_ext import Accelerator
from trainer_ext.distributed.state import DistributedType, DistState, detect_topology

RANK_1_OF_2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def test_process_state_reads_like_accelerates_partial_state() -> None:
    state = DistState(detect_topology(RANK_1_OF_2), cpu=True, init=False)
    assert str(state) == (
        "Distributed environment: DistributedType.MULTI_CPU  Backend: gloo\n"
        "Num processes: 2\nProcess index: 1\nLocal process index: 1\nDevice: cpu\n"
    )
    assert repr(state).startswith("DistState(rank=1/2, ")  # the short form for debugging


def test_an_accelerators_state_adds_its_backend_and_mixed_precision() -> None:
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    assert str(accelerator.state) == (
        "Distributed environment: DistributedType.NO\nNum processes: 1\nProcess index: 0\n"
        "Local process index: 0\nDevice: cpu\n\nMixed precision type: bf16\n"
    )
    state = DistState(detect_topology(RANK_1_OF_2), cpu=True, init=False)
    state.mixed_precision, state.strategy_type = "no", DistributedType.FSDP
    assert str(state).startswith("Distributed environment: DistributedType.FSDP  Backend: gloo\n")
    assert str(state).endswith("Device: cpu\n\nMixed precision type: no\n")
