"""The body the scenario scripts share: build the Trainer, attach the observers, run its stages, report.

A scenario seeds, builds its arguments, model and data as a user script would, and hands them to ``Script``, which
builds ``impl.Trainer`` (or the script's subclass) with a ``BatchTap`` on the model and a ``Recorder`` among the
callbacks where asked. ``Script.run(train(), evaluate(), predict(data), ...)`` then plays the stages, storing each
one's observable value (or the exception it raised) under its name, and returns what ``observe.finish`` reports.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .observe import BatchTap, Recorder, finish, metrics, prediction_output, stage, train_output
from .registry import Impl

# One step of a script: the name its observable goes under, and what it does with the trainer.
Stage = tuple[str, Callable[[Any], Any]]


def train(**kwargs: Any) -> Stage:
    """``trainer.train(**kwargs)``: its ``TrainOutput``."""
    return "train", lambda trainer: train_output(trainer.train(**kwargs))


def evaluate(name: str = "evaluate", **kwargs: Any) -> Stage:
    """``trainer.evaluate(**kwargs)``: its metrics."""
    return name, lambda trainer: metrics(trainer.evaluate(**kwargs))


def predict(dataset: Any, name: str = "predict") -> Stage:
    """``trainer.predict(dataset)``: its ``PredictionOutput``."""
    return name, lambda trainer: prediction_output(trainer.predict(dataset))


class Script:
    """A user's Trainer and the harness's observers on it; ``result`` is what the script has recorded so far.

    ``model``, ``args``, the datasets (those given) and ``trainer_kwargs`` go to the Trainer, or to
    ``trainer_class``, the script's own subclass of ``impl.Trainer``. ``tap``: True puts a ``BatchTap`` on ``model``,
    or pass one (a ``model_init`` attaches it itself). ``record``: add a ``Recorder`` once the Trainer is built.
    """

    def __init__(
        self,
        impl: Impl,
        workdir: Path,
        model: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        *,
        tap: bool | BatchTap = False,
        record: bool = True,
        trainer_class: type | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        self.workdir = workdir
        self.tap = BatchTap(model) if tap is True else tap or None
        given = {"model": model, "args": args, "train_dataset": train_dataset, "eval_dataset": eval_dataset}
        trainer_kwargs.update({name: value for name, value in given.items() if value is not None})
        self.trainer = (trainer_class or impl.Trainer)(**trainer_kwargs)
        self.recorder = Recorder(self.trainer) if record else None
        self.result: dict[str, Any] = {}

    def play(self, *stages: Stage) -> dict[str, Any]:
        """Run the stages in order, each one's value or exception stored in ``result`` under its name."""
        for name, action in stages:
            stage(self.result, name, lambda action=action: action(self.trainer))
        return self.result

    def finish(self, **observed: Callable[[Any], Any]) -> dict[str, Any]:
        """``result`` with the script's own last observations (each computed from the trainer) and ``finish``'s."""
        for name, observe in observed.items():
            self.result[name] = observe(self.trainer)
        return finish(self.result, self.trainer, self.workdir, self.recorder, self.tap)

    def run(self, *stages: Stage, **observed: Callable[[Any], Any]) -> dict[str, Any]:
        """``play`` the stages, then ``finish``."""
        self.play(*stages)
        return self.finish(**observed)
