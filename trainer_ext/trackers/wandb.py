"""Weights & Biases; ``init_kwargs={"mode": "offline"}`` (or WANDB_MODE=offline) needs no network.

As under accelerate, ``wandb.init`` gets the project and the user's ``init_kwargs`` only: runs land where wandb puts
them (``./wandb``, or ``WANDB_DIR``), not under the Accelerator's logging directory.
"""

from __future__ import annotations

from typing import Any

from trainer_ext.trackers.base import Tracker


class WandBTracker(Tracker):
    name = "wandb"
    requires = "wandb"

    def __init__(self, project_name: str, logging_dir: str | None = None, **init_kwargs: Any) -> None:
        super().__init__(project_name, logging_dir, **init_kwargs)
        import wandb

        self.run = wandb.init(project=project_name, **init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()
