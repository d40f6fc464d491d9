"""MainProcessLoggingCallback on one process: what a non-main rank's set-up does, and the printer on other nodes."""

from __future__ import annotations

import io
import logging
import warnings
from types import SimpleNamespace

import pytest
from transformers import DefaultFlowCallback, PrinterCallback, TrainerState
from transformers.utils import logging as hf_logging

from trainer_ext.callbacks import MainProcessLoggingCallback
from trainer_ext.callbacks.main_process_logging import WorldMainPrinterCallback, configure_process_logging


@pytest.fixture
def captured():
    """A handler on the root and transformers loggers, root at INFO (as ``basicConfig(level=INFO)`` leaves it)."""
    stream, root, hf_root = io.StringIO(), logging.getLogger(), logging.getLogger("transformers")
    handler, old_level, old_hf = logging.StreamHandler(stream), root.level, hf_logging.get_verbosity()
    # transformers' records reach the root logger only where it propagates (it does when CI=1 is set)
    hf_targets = [] if hf_root.propagate else [hf_root]
    root.addHandler(handler)
    for logger in hf_targets:
        logger.addHandler(handler)
    root.setLevel(logging.INFO)
    hf_logging.set_verbosity_info()
    yield stream
    root.removeHandler(handler)
    for logger in hf_targets:
        logger.removeHandler(handler)
    root.setLevel(old_level)
    hf_logging.set_verbosity(old_hf)


def _emit() -> None:
    for logger in (logging.getLogger("callbacks_test"), hf_logging.get_logger("transformers.callbacks_test")):
        logger.info("info line")
        logger.warning("warning line")
        logger.error("error line")


def test_a_replica_keeps_warnings_and_errors_with_its_rank(captured: io.StringIO) -> None:
    factory, formatwarning = logging.getLogRecordFactory(), warnings.formatwarning
    undo = configure_process_logging(3)
    try:
        _emit()
        text = warnings.formatwarning("careful", UserWarning, "x.py", 7)
    finally:
        undo()
    assert captured.getvalue().splitlines() == ["[rank 3] warning line", "[rank 3] error line"] * 2
    assert text.startswith("[rank 3] x.py:7: UserWarning: careful")
    assert logging.getLogRecordFactory() is factory and warnings.formatwarning is formatwarning
    assert logging.getLogger().level == logging.INFO and hf_logging.get_verbosity() == logging.INFO


def test_the_main_process_is_left_as_configured(captured: io.StringIO) -> None:
    undo = configure_process_logging(0)
    _emit()
    undo()
    assert captured.getvalue().splitlines() == ["info line", "warning line", "error line"] * 2


def test_captured_warnings_get_one_prefix_only(captured: io.StringIO) -> None:
    undo = configure_process_logging(1)
    logging.captureWarnings(True)
    try:
        warnings.warn_explicit("captured", UserWarning, "y.py", 2)
    finally:
        logging.captureWarnings(False)
        undo()
    assert captured.getvalue().count("[rank 1]") == 1


class _FakeTrainer:
    """What the callback reads of a Trainer on process ``process_index`` (weak-referenceable, unlike a namespace)."""

    def __init__(self, process_index: int) -> None:
        self.args = SimpleNamespace(process_index=process_index, log_level_replica="warning")
        self.callback_handler = SimpleNamespace(callbacks=[DefaultFlowCallback(), PrinterCallback()])


def test_printer_stays_on_the_world_main_process(capsys: pytest.CaptureFixture) -> None:
    """On a second node's local main process the stock PrinterCallback would print every log line."""
    trainer = _FakeTrainer(process_index=4)
    callback = MainProcessLoggingCallback(trainer)
    callback.restore()
    printer = trainer.callback_handler.callbacks[1]
    assert type(printer) is WorldMainPrinterCallback
    state = TrainerState(is_local_process_zero=True, is_world_process_zero=False)
    printer.on_log(trainer.args, state, None, logs={"loss": 1.0})
    assert capsys.readouterr().out == ""
    printer.on_log(trainer.args, TrainerState(is_local_process_zero=True, is_world_process_zero=True), None, {"a": 1})
    assert "'a': 1" in capsys.readouterr().out


def test_the_main_process_keeps_the_stock_printer() -> None:
    trainer = _FakeTrainer(process_index=0)
    MainProcessLoggingCallback(trainer).restore()
    assert type(trainer.callback_handler.callbacks[1]) is PrinterCallback


def test_setting_up_twice_prefixes_once(captured: io.StringIO) -> None:
    """The Trainer installs the callback by default; a user's own instance must not double the prefix."""
    first, second = configure_process_logging(2), configure_process_logging(2)
    try:
        logging.getLogger("callbacks_test").warning("twice")
        text = warnings.formatwarning("careful", UserWarning, "x.py", 7)
    finally:
        second()
        first()
    assert captured.getvalue() == "[rank 2] twice\n"
    assert text.count("[rank 2]") == 1
