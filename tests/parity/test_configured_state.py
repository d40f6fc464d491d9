"""``accelerator_config={"use_configured_state": True}`` under stock transformers + accelerate and under ours.

Both refuse it (ValueError) when no state was set up before the arguments, and both take an accelerate
``PartialState`` that a script set up first. Needs accelerate for the stock side (see tests/parity/README.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from trainer_ext import TrainingArguments

pytest.importorskip("accelerate")

pytestmark = pytest.mark.parity

CONFIGURED = {"use_configured_state": True}


@pytest.fixture
def fresh_accelerate_state():
    """No accelerate state before the test, none left after it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("impl", [transformers.TrainingArguments, TrainingArguments], ids=["stock", "ours"])
def test_nothing_configured_is_refused_by_both(tmp_path: Path, impl: type, fresh_accelerate_state: None) -> None:
    with pytest.raises(ValueError, match="use_configured_state"):
        impl(output_dir=str(tmp_path), report_to="none", use_cpu=True, accelerator_config=CONFIGURED)


@pytest.mark.parametrize("impl", [transformers.TrainingArguments, TrainingArguments], ids=["stock", "ours"])
def test_a_partial_state_set_up_first_is_taken_by_both(
    tmp_path: Path, impl: type, fresh_accelerate_state: None
) -> None:
    from accelerate import PartialState

    PartialState(cpu=True)
    args = impl(output_dir=str(tmp_path), report_to="none", use_cpu=True, accelerator_config=CONFIGURED)
    assert (args.device.type, args.world_size, args.parallel_mode.value) == ("cpu", 1, "not_parallel")
    assert args.accelerator_config.use_configured_state is False  # consumed by the set-up, on both
