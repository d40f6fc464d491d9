"""Parity scenarios: ordinary ``Trainer`` scripts, each returning what its user can observe.

Each scenario is written the way transformers' docs and example scripts use the Trainer; only the two classes
come from ``impl`` (``transformers``' own, or ``trainer_ext``'s). A scenario is ``(impl, workdir) -> dict`` of
JSON-able observables, registered with ``@scenario`` in ``scenarios_training.py``, ``scenarios_loop.py``,
``scenarios_runs.py`` and ``scenarios_options.py``; most build their Trainer and run its stages through ``script.Script``. ``run_scenario.py``
runs one per process and ``compare.py`` compares two results.
"""

from __future__ import annotations

from . import scenarios_loop, scenarios_options, scenarios_runs, scenarios_training
from .registry import SCENARIOS, Impl, scenario

__all__ = [
    "SCENARIOS",
    "Impl",
    "scenario",
    "scenarios_loop",
    "scenarios_options",
    "scenarios_runs",
    "scenarios_training",
]
