"""The engine's own callbacks run by the Trainer's callback handler, after the user's, without being listed.

A script written for ``transformers.Trainer`` inspects, pops or replaces ``trainer.callback_handler.callbacks`` by
position or name; ``trainer_ext.Trainer`` must show it the same list. The engine's duties (timed barriers, per-rank
logging, checked checkpoints, and the extras a job opts into) are kept in :attr:`DutyCallbackHandler.duties`
instead, and called after the listed callbacks for every event. A duty whose class the user put in the list
themselves (``callbacks=[BarrierCallback(timeout=60)]``) steps aside for the user's instance.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

# What transformers' CallbackHandler holds (its __init__ sets exactly these; tests/test_compat.py pins the list)
HANDLER_STATE = (
    "callbacks",
    "model",
    "processing_class",
    "optimizer",
    "lr_scheduler",
    "train_dataloader",
    "eval_dataloader",
)


class DutyCallbackHandler(CallbackHandler):
    """transformers' ``CallbackHandler`` plus a private list of duties called after the public callbacks."""

    duties: list[TrainerCallback]

    @classmethod
    def wrap(cls, handler: CallbackHandler, duties: list[TrainerCallback]) -> DutyCallbackHandler:
        """The same handler (same list object, same references) with ``duties`` added behind it."""
        if isinstance(handler, cls):
            handler.duties.extend(duties)
            return handler
        wrapped = cls.__new__(cls)  # not __init__: it would copy the list and warn again about duplicates
        for name in HANDLER_STATE:
            setattr(wrapped, name, getattr(handler, name))
        wrapped.duties = list(duties)
        return wrapped

    def add_duty(self, duty: TrainerCallback) -> None:
        """Add a duty once (a second instance of the same class is ignored)."""
        if not any(type(d) is type(duty) for d in self.duties):
            self.duties.append(duty)

    def duty(self, kind: type) -> Any:
        """The duty of class ``kind`` (or the user's listed instance that replaces it), or None."""
        for callback in (*self.callbacks, *self.duties):
            if isinstance(callback, kind):
                return callback
        return None

    def _active_duties(self) -> list[TrainerCallback]:
        return [d for d in self.duties if not any(isinstance(c, type(d)) for c in self.callbacks)]

    def call_event(self, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        control = super().call_event(event, args, state, control, **kwargs)
        for duty in self._active_duties():
            result = getattr(duty, event)(
                args,
                state,
                control,
                model=self.model,
                processing_class=self.processing_class,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                train_dataloader=self.train_dataloader,
                eval_dataloader=self.eval_dataloader,
                **kwargs,
            )
            if result is not None:
                control = result
        return control
