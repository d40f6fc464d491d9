"""The tracker interface: one experiment-logging backend, created and written by the main process only."""

from __future__ import annotations

import importlib.util
from typing import Any

from trainer_ext.errors import ConfigError


class Tracker:
    """Subclasses set ``name`` and ``requires`` (the import name) and implement the three methods."""

    name = "base"
    requires = ""
    pip_name = ""

    @classmethod
    def available(cls) -> bool:
        return importlib.util.find_spec(cls.requires) is not None

    @classmethod
    def check_installed(cls) -> None:
        if not cls.available():
            raise ConfigError(
                f"tracker {cls.name!r} needs the {cls.pip_name or cls.requires!r} package, which is not installed: "
                f"pip install {cls.pip_name or cls.requires} (every tracker, from a checkout: "
                "pip install -e '.[trackers]')"
            )

    def __init__(self, project_name: str, logging_dir: str | None = None, **init_kwargs: Any) -> None:
        self.project_name = project_name
        self.logging_dir = logging_dir
        self.init_kwargs = init_kwargs

    @property
    def tracker(self) -> Any:
        """The backend's own object (SummaryWriter, wandb run, mlflow module …)."""
        raise NotImplementedError

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        raise NotImplementedError

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` at ``step``; ``kwargs`` go to the backend's own logging call (``log_kwargs``)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Flush and close; the default has nothing to close."""


def scalars(values: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of ``values`` (trackers that only take numbers get these)."""
    out = {}
    for key, value in values.items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out
