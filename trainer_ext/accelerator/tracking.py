"""The ``Accelerator``'s experiment trackers: started on the main process, blank everywhere else."""

from __future__ import annotations

from typing import Any

from trainer_ext.errors import ConfigError
from trainer_ext.trackers import TRACKERS, BlankTracker, Tracker, resolve_trackers


class Trackers:
    """The trackers named by ``log_with``: ``requested`` when the Accelerator is made, ``started`` (accelerate's
    ``accelerator.trackers``) by :meth:`init` on the main process."""

    def __init__(self, log_with: str | Tracker | list[str | Tracker] | None) -> None:
        self.requested: list[str | Tracker] = resolve_trackers(log_with)
        self.started: list[Tracker] = []

    def init(
        self,
        project_name: str,
        logging_dir: str | None,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict] | None = None,
    ) -> None:
        """Start every requested tracker (the caller runs this on the main process only); store ``config``."""
        init_kwargs = init_kwargs or {}
        for item in self.requested:
            if isinstance(item, Tracker):
                tracker = item
            else:
                tracker = TRACKERS[item](project_name, logging_dir, **init_kwargs.get(item, {}))
            if config is not None:
                tracker.store_init_configuration(config)
            self.started.append(tracker)

    def get(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker ``name`` (its backend object with ``unwrap``); where it does not run (other ranks,
        before ``init_trackers``, no ``log_with``) a blank tracker whose every call does nothing."""
        for tracker in self.started:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        requested = [item if isinstance(item, str) else item.name for item in self.requested]
        if requested and name not in requested:  # the same answer on every rank
            raise ConfigError(f"no tracker {name!r}: log_with asked for {requested}; use one of those names")
        blank = BlankTracker(name)
        return blank.tracker if unwrap else blank

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, dict] | None = None) -> None:
        """Log to every started tracker; ``log_kwargs[name]`` goes to that tracker's call."""
        for tracker in self.started:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def finish(self) -> None:
        """Finish every started tracker and forget them."""
        for tracker in self.started:
            tracker.finish()
        self.started.clear()
