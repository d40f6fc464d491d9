"""MLflow with a local file store (``logging_dir/mlruns``) unless a tracking URI is configured."""

from __future__ import annotations

import os
from typing import Any

from trainer_ext.trackers.base import Tracker, scalars


class MLflowTracker(Tracker):
    name = "mlflow"
    requires = "mlflow"
    pip_name = "mlflow-skinny"

    def __init__(self, project_name: str, logging_dir: str | None = None, **init_kwargs: Any) -> None:
        super().__init__(project_name, logging_dir, **init_kwargs)
        import mlflow

        self.mlflow = mlflow
        uri = init_kwargs.pop("tracking_uri", None) or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            # a local file store needs no server or database; mlflow>=3.10 asks for this opt-in to use it
            uri = "file://" + os.path.abspath(os.path.join(logging_dir or ".", "mlruns"))
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(project_name)
        self.run = mlflow.start_run(**init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.mlflow.log_params({k: str(v)[:500] for k, v in values.items()})

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.mlflow.log_metrics(scalars(values), step=step, **kwargs)

    def finish(self) -> None:
        self.mlflow.end_run()
