"""When the ranks agree on a preemption signal: every N steps, or (the default) about every 2 s and at the end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer_ext.checkpointing import preemption
from trainer_ext.checkpointing.preemption import PreemptionCallback, steps_between_checks


def test_steps_between_checks_follows_the_step_time() -> None:
    assert steps_between_checks(0.1, 2.0) == 20
    assert steps_between_checks(3.0, 2.0) == 1  # slow steps: every step
    assert steps_between_checks(0.0, 2.0) == 1  # nothing measured yet
    assert steps_between_checks(1e-9, 2.0) == preemption.MAX_CHECK_STEPS


def _agreements(monkeypatch: pytest.MonkeyPatch, callback: PreemptionCallback, steps: int, signal_at: int = 0):
    """Run ``steps`` step ends 0.1 s apart on a pretend 2-rank job; the steps at which the ranks agreed."""
    clock = {"now": 100.0}
    agreed: list[int] = []
    state = SimpleNamespace(global_step=0, max_steps=steps)

    def fake_agreed(flag: bool, step_seconds: float, group=None):
        agreed.append(state.global_step)
        return flag, step_seconds

    monkeypatch.setattr(preemption, "_agreed", fake_agreed)
    monkeypatch.setattr(preemption, "_several_ranks", lambda: True)
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock["now"])
    stopped_at = None
    for step in range(1, steps + 1):
        clock["now"] += 0.1
        state.global_step = step
        if step == signal_at:
            callback.flag.signum, callback.flag.received_at = 15, clock["now"]
        control = SimpleNamespace(should_training_stop=step == steps, should_save=False)
        callback.on_step_end(None, state, control)
        if control.should_save:
            stopped_at = step
            break
    return agreed, stopped_at


def test_by_default_several_ranks_agree_about_every_two_seconds_and_at_the_last_step(monkeypatch) -> None:
    agreed, stopped = _agreements(monkeypatch, PreemptionCallback(grace_seconds=30.0), steps=100)
    # step 1 starts the clock, step 2 measures 0.1 s per step: every 20 steps from there, and the last step
    assert agreed == [1, 2, 22, 42, 62, 82, 100]
    assert stopped is None


def test_a_signal_is_acted_on_at_the_next_agreement(monkeypatch) -> None:
    agreed, stopped = _agreements(monkeypatch, PreemptionCallback(grace_seconds=30.0), steps=100, signal_at=30)
    assert stopped == 42 and agreed == [1, 2, 22, 42]


def test_a_short_grace_time_shortens_the_interval(monkeypatch) -> None:
    agreed, _ = _agreements(monkeypatch, PreemptionCallback(grace_seconds=5.0), steps=30)
    assert agreed == [1, 2, 7, 12, 17, 22, 27, 30]  # a tenth of 5 s: every 5 steps of 0.1 s


def test_preemption_check_steps_agrees_every_n_steps_and_at_the_last(monkeypatch) -> None:
    agreed, _ = _agreements(monkeypatch, PreemptionCallback(grace_seconds=30.0, check_every=4), steps=10)
    assert agreed == [4, 8, 10]
