"""Only the main process prints and logs; the other ranks log warnings and errors, prefixed ``[rank N]``.

What transformers' Trainer already does, and this module does not repeat: the logged training ``loss`` is the mean over
ranks (``_maybe_log_save_evaluate`` all-gathers each rank's running loss and averages it), ``ProgressCallback`` draws
only on the world main process, and the transformers verbosity is set per process from ``log_level`` /
``log_level_replica``. What it leaves open, and this module closes:

- "main" there is each node's *local* main process (``log_on_each_node`` defaults to True), and ``PrinterCallback``
  (used with ``disable_tqdm``) prints on every node's local main process: here only the world main process counts;
- Python's own logging (the root logger, which ``logging.basicConfig(level=INFO)`` scripts raise) is untouched, so
  every rank repeats every INFO line: here the other ranks are lowered to the replica level;
- nothing says which rank a warning came from: here every log record and Python warning of rank N starts with
  ``[rank N]``, through the standard library's two hooks for it (the log-record factory and
  ``warnings.formatwarning``), chained to the previous ones, set once per process and put back by ``restore()``.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from transformers import PrinterCallback, TrainerCallback
from transformers.training_args import trainer_log_levels
from transformers.utils import logging as hf_logging


def rank_prefix(process_index: int) -> str:
    """The text put before every log record and warning of a non-main rank."""
    return f"[rank {process_index}] "


_lock = threading.Lock()
_shared: dict[str, Any] = {}  # the process's one prefixing set-up: its key (rank, level), users and undo function


def configure_process_logging(process_index: int, replica_level: int = logging.WARNING) -> Callable[[], None]:
    """Quiet a non-main rank to ``replica_level`` and prefix its records and warnings; returns the undo function.

    On the main process (index 0) nothing changes. The root logger is only ever made quieter, never louder; the
    transformers verbosity is set to ``replica_level`` as transformers itself does for its replicas. Every call with
    the same rank and level shares one set-up, undone when the last of them is undone (in any order).
    """
    if process_index == 0:
        return lambda: None
    key = (process_index, replica_level)
    with _lock:
        if _shared.get("key") == key:
            _shared["users"] += 1
        elif not _shared:
            _shared.update(key=key, users=1, undo=_install(process_index, replica_level))
        else:  # another rank or level in the same process (tests): a layer of its own, undone by its caller
            return _install(process_index, replica_level)
    released = False

    def undo() -> None:
        nonlocal released
        with _lock:
            if released:
                return
            released = True
            _shared["users"] -= 1
            if _shared["users"]:
                return
            restore = _shared["undo"]
            _shared.clear()
        restore()

    return undo


def _install(process_index: int, replica_level: int) -> Callable[[], None]:
    """Set the levels, and chain the record factory and ``warnings.formatwarning`` (the standard library's hooks)."""
    prefix = rank_prefix(process_index)
    root = logging.getLogger()
    old_root_level, old_hf_level = root.level, hf_logging.get_verbosity()
    old_factory, old_formatwarning = logging.getLogRecordFactory(), warnings.formatwarning

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = old_factory(*args, **kwargs)
        if not str(record.msg).startswith(prefix):  # captured warnings are already prefixed
            record.msg = prefix + str(record.msg)
        return record

    def formatwarning(*args: Any, **kwargs: Any) -> str:
        text = old_formatwarning(*args, **kwargs)
        return text if text.startswith(prefix) else prefix + text  # set up twice: one prefix

    root.setLevel(max(old_root_level, replica_level))
    hf_logging.set_verbosity(replica_level)
    logging.setLogRecordFactory(factory)
    warnings.formatwarning = formatwarning

    def undo() -> None:
        root.setLevel(old_root_level)
        hf_logging.set_verbosity(old_hf_level)
        if logging.getLogRecordFactory() is factory:
            logging.setLogRecordFactory(old_factory)
        if warnings.formatwarning is formatwarning:
            warnings.formatwarning = old_formatwarning

    return undo


class WorldMainPrinterCallback(PrinterCallback):
    """``PrinterCallback`` that prints on the world main process only (the stock one prints on every node)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            super().on_log(args, state, control, logs=logs, **kwargs)


class MainProcessLoggingCallback(TrainerCallback):
    """Sets up logging per rank when the Trainer is built (given ``trainer``) or at the latest when training starts.

    Pass the trainer (``MainProcessLoggingCallback(trainer)``) to set it up at once and to keep ``PrinterCallback``
    to the world main process on multi-node jobs; without it only the logging levels and prefixes are set.
    """

    def __init__(self, trainer: Any = None) -> None:
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self._undo: Callable[[], None] | None = None
        if trainer is not None:
            self._setup(trainer.args)

    def _setup(self, args: Any) -> None:
        if self._undo is None:
            level = trainer_log_levels[args.log_level_replica]
            self._undo = configure_process_logging(args.process_index, logging.WARNING if level < 0 else level)
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None and args.process_index != 0:
            callbacks = trainer.callback_handler.callbacks
            for i, callback in enumerate(callbacks):
                # replaced in place: the handler may be iterating over this list right now
                if type(callback) is PrinterCallback:
                    callbacks[i] = WorldMainPrinterCallback()

    def restore(self) -> None:
        """Undo the logging set-up (tests, or a process that goes on after training)."""
        if self._undo is not None:
            self._undo()
            self._undo = None

    def on_init_end(self, args, state, control, **kwargs):
        self._setup(args)

    def on_train_begin(self, args, state, control, **kwargs):
        self._setup(args)
