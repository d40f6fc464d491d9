"""``compute_metrics`` for a Trainer built from metric names: streams each evaluation batch into the metric objects.

It speaks transformers' ``batch_eval_metrics`` protocol (``compute_metrics(eval_pred, compute_result)`` once per
batch, the result on the last), so evaluation keeps no logits; called the classic way, with every prediction at once
and no ``compute_result``, it gives the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainer_ext.metrics.base import Metric
from trainer_ext.metrics.registry import CLASSIFICATION, metric_class, normalize_name

AVERAGED = ("f1", "precision", "recall")


class TrainerMetrics:
    """Callable ``compute_metrics``: each call adds a batch to every metric; ``compute_result=True`` reads them out."""

    def __init__(self, metrics: Sequence[Metric]) -> None:
        self.metrics = list(metrics)

    def __call__(self, eval_pred: Any, compute_result: bool = True) -> dict[str, float]:
        predictions = eval_pred.predictions
        if isinstance(predictions, (tuple, list)):  # (logits, hidden states …): the logits come first
            predictions = predictions[0]
        for metric in self.metrics:
            metric.add_batch(predictions=predictions, references=eval_pred.label_ids)
        if not compute_result:
            return {}
        results: dict[str, float] = {}
        for metric in self.metrics:
            results.update(metric.compute())
        return results


def parse_names(value: str | Sequence[str] | None) -> list[str] | None:
    """``"accuracy, f1"`` or ``["accuracy", "f1"]`` → ``["accuracy", "f1"]``; None stays None (the job's default)."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [str(item) for item in value]
    names = [normalize_name(part) for item in items for part in item.split(",") if part.strip()]
    return list(dict.fromkeys(names))


def default_average(num_classes: int) -> str:
    """binary (the class with id 1) for two classes, macro for more."""
    return "binary" if num_classes <= 2 else "macro"


def build_metrics(task: str, names: Sequence[str], num_classes: int = 0, average: str | None = None) -> list[Metric]:
    """The metric objects for a job; ConfigError for a name unknown or unfit for ``task``."""
    metrics = []
    for name in names:
        cls = metric_class(name, task)
        if task == CLASSIFICATION and normalize_name(name) in AVERAGED:
            metrics.append(cls(average=average or default_average(num_classes), num_classes=num_classes))
        elif task == CLASSIFICATION:
            metrics.append(cls(num_classes=num_classes))
        else:
            metrics.append(cls())
    return metrics
