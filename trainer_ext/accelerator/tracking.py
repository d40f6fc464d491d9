"""The ``Accelerator``'s experiment trackers: started on the main process, blank everywhere else."""

from __future__ import annotations

from typing import Any

from trainer_ext.errors import ConfigError
from trainer_ext.trackers import TRACKERS, BlankTracker, Tracker


class TrackingMixin:
    """``init_trackers``, ``get_tracker`` and ``log`` over the trackers named by ``log_with``."""

    is_main_process: bool
    logging_dir: str | None
    trackers: list[Tracker]
    _trackers_requested: list[Any]

    def init_trackers(
        self, project_name: str, config: dict[str, Any] | None = None, init_kwargs: dict[str, dict] | None = None
    ) -> None:
        """Start the trackers from ``log_with`` on the main process; store ``config`` as hyper-parameters."""
        if not self.is_main_process:
            return
        init_kwargs = init_kwargs or {}
        for item in self._trackers_requested:
            if isinstance(item, Tracker):
                tracker = item
            else:
                tracker = TRACKERS[item](project_name, self.logging_dir, **init_kwargs.get(item, {}))
            if config is not None:
                tracker.store_init_configuration(config)
            self.trackers.append(tracker)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker ``name`` (its backend object with ``unwrap``); where it does not run (other ranks,
        before ``init_trackers``, no ``log_with``) a blank tracker whose every call does nothing."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        requested = [item if isinstance(item, str) else item.name for item in self._trackers_requested]
        if requested and name not in requested:  # the same answer on every rank
            raise ConfigError(f"no tracker {name!r}: log_with asked for {requested}; use one of those names")
        blank = BlankTracker(name)
        return blank.tracker if unwrap else blank

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, dict] | None = None) -> None:
        """Log to every started tracker (main process only); ``log_kwargs[name]`` goes to that tracker's call."""
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))
