"""Trackio (local-first experiment tracking, wandb-like API)."""

from __future__ import annotations

from typing import Any

from trainer_ext.trackers.base import Tracker


class TrackioTracker(Tracker):
    name = "trackio"
    requires = "trackio"

    def __init__(self, project_name: str, logging_dir: str | None = None, **init_kwargs: Any) -> None:
        super().__init__(project_name, logging_dir, **init_kwargs)
        import trackio

        self.module = trackio
        self.run = trackio.init(project=project_name, **init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.module.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.module.finish()
