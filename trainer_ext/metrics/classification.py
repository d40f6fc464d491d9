"""Classification metrics from one running confusion matrix: accuracy, f1, precision, recall, Matthews correlation.

Values and options follow scikit-learn (and so ``evaluate``'s hub metrics, which call it): ``average`` is one of
binary (the class ``pos_label`` only), macro, micro, weighted; a ratio with a zero denominator counts as 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import Metric, to_numpy

AVERAGES = ("binary", "macro", "micro", "weighted")


def class_ids(predictions: Any, references: Any) -> tuple[np.ndarray, np.ndarray]:
    """Predicted and true class ids as flat int64 arrays; logits (one more axis than the references) are argmaxed."""
    preds, refs = to_numpy(predictions), to_numpy(references)
    if preds.ndim == refs.ndim + 1:
        preds = preds.argmax(axis=-1)
    preds, refs = preds.reshape(-1), refs.reshape(-1)
    if preds.shape != refs.shape:
        raise ValueError(f"{preds.size} predictions but {refs.size} references")
    for what, values in (("predictions", preds), ("references", refs)):
        if values.size and not np.all(np.equal(np.mod(values, 1), 0)):
            raise ValueError(f"{what} must be class ids (integers) or logits, got e.g. {values[0]!r}")
    preds, refs = preds.astype(np.int64), refs.astype(np.int64)
    if preds.size and min(preds.min(), refs.min()) < 0:
        raise ValueError("class ids must be 0 or more (drop ignored examples before adding them)")
    return preds, refs


class ConfusionMetric(Metric):
    """Keeps a growing ``confusion[true, predicted]`` count matrix: memory is classes², whatever the data size."""

    def __init__(self, num_classes: int = 0) -> None:
        self.num_classes = num_classes
        super().__init__()

    def reset(self) -> None:
        self.confusion = np.zeros((self.num_classes, self.num_classes), dtype=np.int64)

    def add_batch(self, *, predictions: Any, references: Any) -> None:
        preds, refs = class_ids(predictions, references)
        if not preds.size:
            return
        size = max(int(preds.max()), int(refs.max()), len(self.confusion) - 1) + 1
        if size > len(self.confusion):
            grown = np.zeros((size, size), dtype=np.int64)
            grown[: len(self.confusion), : len(self.confusion)] = self.confusion
            self.confusion = grown
        self.confusion += np.bincount(refs * size + preds, minlength=size * size).reshape(size, size)

    @property
    def total(self) -> int:
        return int(self.confusion.sum())


class Accuracy(ConfusionMetric):
    """Share of examples whose predicted class is the true one (``normalize=False``: their number)."""

    name = "accuracy"

    def __init__(self, normalize: bool = True, num_classes: int = 0) -> None:
        self.normalize = normalize
        super().__init__(num_classes)

    def _result(self) -> dict[str, float]:
        correct = float(np.trace(self.confusion))
        if not self.normalize:
            return {self.name: correct}
        return {self.name: correct / self.total if self.total else float("nan")}


class _Averaged(ConfusionMetric):
    """Per-class precision/recall/f1 from the counts, then averaged over classes as ``average`` says."""

    def __init__(
        self, average: str = "binary", pos_label: int = 1, labels: Sequence[int] | None = None, num_classes: int = 0
    ) -> None:
        if average not in AVERAGES:
            raise ValueError(f"{self.name}: average must be one of {', '.join(AVERAGES)}, got {average!r}")
        self.average, self.pos_label = average, int(pos_label)
        self.labels = None if labels is None else [int(label) for label in labels]
        super().__init__(max([num_classes, *(label + 1 for label in self.labels or [])]))

    @staticmethod
    def _score(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _result(self) -> dict[str, float]:
        if not self.total:
            return {self.name: float("nan")}
        present = [int(c) for c in np.flatnonzero(self.confusion.sum(axis=0) + self.confusion.sum(axis=1))]
        if self.average == "binary":
            if len(present) > 2:
                raise ValueError(
                    f"{self.name}: the data has {len(present)} classes but average='binary' scores one class of "
                    "two; pass average='macro', 'micro' or 'weighted'"
                )
            if len(present) == 2 and self.pos_label not in present:
                raise ValueError(f"{self.name}: pos_label={self.pos_label} is not one of the classes {present}")
            chosen = [self.pos_label]
        else:
            chosen = self.labels if self.labels is not None else present
        size = max(len(self.confusion), max(chosen) + 1)  # a class never seen has all counts 0
        matrix = np.zeros((size, size), dtype=np.float64)
        matrix[: len(self.confusion), : len(self.confusion)] = self.confusion
        tp = np.diag(matrix)
        fp, fn, support = matrix.sum(axis=0) - tp, matrix.sum(axis=1) - tp, matrix.sum(axis=1)
        tp, fp, fn, support = tp[chosen], fp[chosen], fn[chosen], support[chosen]
        if self.average == "micro":
            tp, fp, fn = tp.sum(keepdims=True), fp.sum(keepdims=True), fn.sum(keepdims=True)
            return {self.name: float(self._score(tp, fp, fn)[0])}
        scores = self._score(tp, fp, fn)
        if self.average == "weighted":
            return {self.name: float((scores * support).sum() / support.sum()) if support.sum() else 0.0}
        return {self.name: float(scores.mean())}


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0 (scikit-learn's zero_division default)."""
    out = np.zeros_like(numerator, dtype=np.float64)
    np.divide(numerator, denominator, out=out, where=denominator > 0)
    return out


class Precision(_Averaged):
    """Of the examples predicted as a class, the share that belong to it: tp / (tp + fp)."""

    name = "precision"

    @staticmethod
    def _score(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
        return _ratio(tp, tp + fp)


class Recall(_Averaged):
    """Of the examples of a class, the share predicted as it: tp / (tp + fn)."""

    name = "recall"

    @staticmethod
    def _score(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
        return _ratio(tp, tp + fn)


class F1(_Averaged):
    """Harmonic mean of precision and recall: 2 tp / (2 tp + fp + fn)."""

    name = "f1"

    @staticmethod
    def _score(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
        return _ratio(2 * tp, 2 * tp + fp + fn)


class MatthewsCorrelation(ConfusionMetric):
    """Matthews correlation coefficient over all classes (scikit-learn's multi-class form): -1 … 1, 0 for chance."""

    name = "matthews_correlation"

    def _result(self) -> dict[str, float]:
        if not self.total:
            return {self.name: float("nan")}
        matrix = self.confusion.astype(np.float64)
        true, predicted = matrix.sum(axis=1), matrix.sum(axis=0)
        correct, samples = np.trace(matrix), matrix.sum()
        covariance = correct * samples - true @ predicted
        denominator = np.sqrt((samples**2 - predicted @ predicted) * (samples**2 - true @ true))
        return {self.name: float(covariance / denominator) if denominator else 0.0}
