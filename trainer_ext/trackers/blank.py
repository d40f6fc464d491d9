"""The stand-in tracker of processes that run none (accelerate's blank tracker): every call does nothing."""

from __future__ import annotations

from typing import Any

from trainer_ext.trackers.base import Tracker


class _Nothing:
    """Any attribute is this object again and any call returns None: a harmless backend object."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # keep copy/pickle/introspection protocols ordinary
            raise AttributeError(name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __repr__(self) -> str:
        return "<no tracker on this process>"


NOTHING = _Nothing()


class BlankTracker(Tracker):
    """What ``Accelerator.get_tracker`` gives where a tracker does not run, so one code path serves every rank."""

    def __init__(self, name: str = "blank") -> None:
        super().__init__(project_name="")
        self.name = name

    @property
    def tracker(self) -> Any:
        return NOTHING

    def store_init_configuration(self, *args: Any, **kwargs: Any) -> None:
        """Nothing is stored: this process runs no tracker."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        """Nothing is logged: this process runs no tracker."""

    def finish(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to close."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return NOTHING
