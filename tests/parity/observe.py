"""What a user of the Trainer can observe, turned into JSON-able values for the parity scenarios.

Imported by the scenario scripts only (never by the comparison), in a process that runs one implementation.
"""

from __future__ import annotations

import hashlib
import math
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from tests.parity_harness.workload import files_under

# Metric keys whose values depend on the clock or the allocator: their presence is compared, never their value.
VOLATILE = re.compile(r"(_runtime$|_per_second$|_preparation_time$|_mem_|^total_flos$)")


def jsonable(value: Any) -> Any:
    """Plain JSON types: numpy/torch scalars become numbers, NaN/inf become strings, tuples lists."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return jsonable(value.tolist()) if value.numel() <= 16 else array_summary(value)
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist()) if value.size <= 16 else array_summary(value)
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return f"<{type(value).__name__}>"


def metrics(values: dict[str, Any] | None) -> dict[str, Any] | None:
    """A metrics dict with the clock- and allocator-dependent values blanked (keys kept)."""
    if values is None:
        return None
    return {k: (None if VOLATILE.search(k) else jsonable(v)) for k, v in sorted(values.items())}


def log_history(trainer: Any) -> list[dict[str, Any]]:
    """``trainer.state.log_history`` entry by entry (loss, learning_rate, grad_norm, epoch, step, eval metrics)."""
    return [metrics(entry) for entry in trainer.state.log_history]


def train_output(output: Any) -> dict[str, Any]:
    """The ``TrainOutput`` returned by ``train()``."""
    return {
        "global_step": output.global_step,
        "training_loss": jsonable(output.training_loss),
        "metrics": metrics(output.metrics),
    }


def array_summary(value: Any) -> Any:
    """Shape, dtype and sum of an array (or a tuple of arrays), enough to compare predictions."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return [array_summary(v) for v in value]
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().float().numpy()
    array = np.asarray(value)
    summary: dict[str, Any] = {"shape": list(array.shape), "dtype": str(array.dtype)}
    if array.dtype.kind in "fiub" and array.size:
        summary["sum"] = jsonable(float(array.astype(np.float64).sum()))
        summary["abs_sum"] = jsonable(float(np.abs(array.astype(np.float64)).sum()))
    return summary


def prediction_output(output: Any) -> dict[str, Any]:
    """The ``PredictionOutput`` returned by ``predict()``."""
    return {
        "predictions": array_summary(output.predictions),
        "label_ids": array_summary(output.label_ids),
        "metrics": metrics(output.metrics),
    }


def weights(model: torch.nn.Module) -> dict[str, Any]:
    """The final weights: a bitwise hash, and per tensor its sum and absolute sum (compared with a tolerance)."""
    digest = hashlib.sha256()
    tensors = {}
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        as64 = tensor.double()
        tensors[name] = {
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype),
            "sum": jsonable(as64.sum().item()),
            "abs_sum": jsonable(as64.abs().sum().item()),
        }
    return {"sha256": digest.hexdigest(), "tensors": tensors}


def callback_names(trainer: Any, exclude: tuple[type, ...] = ()) -> list[str]:
    """Class names of ``trainer.callback_handler.callbacks`` in order (the harness's own recorder left out)."""
    return [type(cb).__name__ for cb in trainer.callback_handler.callbacks if not isinstance(cb, exclude)]


def error(exc: BaseException) -> dict[str, Any]:
    """An exception as a user sees it: its type (and the types an ``except`` could name) and its message."""
    return {
        "type": type(exc).__name__,
        "bases": [cls.__name__ for cls in type(exc).__mro__[1:] if cls not in (object, BaseException)],
        "message": str(exc),
        "where": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:])[-1500:],
    }


def stage(result: dict[str, Any], name: str, action: Callable[[], Any]) -> Any:
    """Run one step of a script, storing its observable value, or the exception it raised, under ``name``."""
    try:
        value = action()
    except Exception as exc:  # the exception is the observable
        result[name] = {"error": error(exc)}
        return None
    result[name] = value
    return value


class Recorder(TrainerCallback):
    """Records the callback list when training begins and the events the Trainer sends, in order."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.at_init = callback_names(trainer)
        self.at_train_begin: list[list[str]] = []
        self.events: list[str] = []
        trainer.add_callback(self)

    def _event(self, name: str, state: Any) -> None:
        self.events.append(f"{name}@{state.global_step}")

    def on_train_begin(self, args, state, control, **kwargs):
        self.at_train_begin.append(callback_names(self.trainer, exclude=(Recorder,)))
        self._event("on_train_begin", state)


for _event_name in (
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_substep_end",
    "on_step_end",
    "on_evaluate",
    "on_predict",
    "on_save",
    "on_log",
):

    def _handler(self, args, state, control, _name=_event_name, **kwargs):
        self._event(_name, state)

    setattr(Recorder, _event_name, _handler)


class BatchTap:
    """Records which samples each forward call saw (training and evaluation apart), from a forward pre-hook.

    Samples are named by their ``idx`` input (custom models) or the first token of ``input_ids`` (the
    scenarios' token data puts the sample number there).
    """

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.train: list[list[int]] = []
        self.eval: list[list[int]] = []
        if model is not None:
            self.attach(model)

    def attach(self, model: torch.nn.Module) -> torch.nn.Module:
        model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return model

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("idx")
        if ids is None:
            tokens = kwargs.get("input_ids", args[0] if args else None)
            ids = tokens[:, 0] if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 else None
        if ids is not None:
            (self.train if module.training else self.eval).append([int(i) for i in ids.reshape(-1)])

    def summary(self) -> dict[str, list[list[int]]]:
        return {"train": self.train, "eval": self.eval}


def relative(path: str | None, root: Path) -> str | None:
    """A path the Trainer reports, relative to the scenario's working directory."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        return str(path)


def finish(result: dict[str, Any], trainer: Any, workdir: Path, recorder: Recorder | None, tap: BatchTap | None):
    """The observables every scenario reports, added to what the script itself recorded."""
    result["global_step"] = trainer.state.global_step
    result["log_history"] = log_history(trainer)
    result["best_model_checkpoint"] = relative(trainer.state.best_model_checkpoint, workdir)
    result["best_metric"] = jsonable(trainer.state.best_metric)
    result["weights"] = weights(trainer.model) if trainer.model is not None else None
    result["files"] = files_under(workdir)
    if recorder is not None:
        result["callbacks_at_init"] = recorder.at_init
        result["callbacks_at_train_begin"] = recorder.at_train_begin
        result["events"] = recorder.events
    if tap is not None:
        result["batches"] = tap.summary()
    return result
