"""The registry of parity scenarios and the implementation handle each scenario receives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Scenario = Callable[[Any, Path], dict[str, Any]]


SCENARIOS: dict[str, Scenario] = {}


def scenario(function: Scenario) -> Scenario:
    SCENARIOS[function.__name__] = function
    return function


@dataclass(frozen=True)
class Impl:
    """The implementation under test: its name and its two classes."""

    name: str
    Trainer: type
    TrainingArguments: type
