"""TensorBoard through ``torch.utils.tensorboard`` (event files under ``logging_dir/project_name``)."""

from __future__ import annotations

import os
import time
from typing import Any

import yaml

from trainer_ext.trackers.base import Tracker, scalars


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    requires = "tensorboard"

    def __init__(self, project_name: str, logging_dir: str | None = None, **init_kwargs: Any) -> None:
        super().__init__(project_name, logging_dir, **init_kwargs)
        from torch.utils.tensorboard import SummaryWriter

        self.logging_dir = os.path.join(logging_dir or ".", project_name)
        self.writer = SummaryWriter(self.logging_dir, **init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """TensorBoard's hparams, and (as accelerate does) a ``hparams.yml`` in a folder named by the time."""
        self.writer.add_hparams(
            {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}, {}
        )
        self.writer.flush()
        folder = os.path.join(self.logging_dir, str(time.time()))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hparams.yml"), "w") as out:
            try:
                yaml.dump(values, out)
            except yaml.representer.RepresenterError:
                out.seek(0)
                out.truncate()
                yaml.dump({k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}, out)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Strings as text, numbers as scalars; ``kwargs`` (``walltime`` …) go to ``add_text``/``add_scalar``."""
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
        for key, value in scalars(values).items():
            self.writer.add_scalar(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()
