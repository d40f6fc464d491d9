"""Offline evaluation metrics with ``evaluate``'s API: ``load("f1").compute(predictions=..., references=...)``.

Our own small implementations (classification: accuracy, f1, precision, recall, matthews_correlation; causal LM:
perplexity and next-token accuracy) stream: ``add_batch`` keeps counts, never predictions. See docs/metrics.md.
"""

from __future__ import annotations

from trainer_ext.metrics.base import Metric
from trainer_ext.metrics.classification import AVERAGES, F1, Accuracy, MatthewsCorrelation, Precision, Recall
from trainer_ext.metrics.for_trainer import TrainerMetrics, build_metrics, parse_names
from trainer_ext.metrics.language_modeling import IGNORE_INDEX, Perplexity, TokenAccuracy
from trainer_ext.metrics.registry import NAMES, TASK_METRICS, load

__all__ = [
    "AVERAGES",
    "F1",
    "IGNORE_INDEX",
    "NAMES",
    "TASK_METRICS",
    "Accuracy",
    "MatthewsCorrelation",
    "Metric",
    "Perplexity",
    "Precision",
    "Recall",
    "TokenAccuracy",
    "TrainerMetrics",
    "build_metrics",
    "load",
    "parse_names",
]
