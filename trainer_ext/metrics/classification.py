"""Classification metrics from one running confusion matrix: accuracy, f1, precision, recall, Matthews correlation.

Values and options follow scikit-learn (and so ``evaluate``'s hub metrics, which call it): ``average`` is one of
binary (the class ``pos_label`` only), macro, micro, weighted; a ratio with a zero denominator counts as 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trainer_ext.metrics.base import Metric, to_numpy

AVERAGES = ("binary", "macro", "micro", "weighted")
MAX_ID = 2**62  # class ids as int64, with room to spare


def class_ids(predictions: Any, references: Any) -> tuple[np.ndarray, np.ndarray]:
    """Predicted and true class ids as flat int64 arrays; logits (one more axis than the references) are argmaxed."""
    try:
        preds, refs = to_numpy(predictions), to_numpy(references)
    except (TypeError, ValueError) as error:  # ragged lists, objects numpy cannot hold
        raise ValueError(f"predictions and references must be arrays of class ids or logits: {error}") from error
    for what, values in (("predictions", preds), ("references", refs)):
        if values.dtype.kind not in "biuf":
            raise ValueError(f"{what} must be class ids (integers) or logits, got an array of {values.dtype}")
    if preds.ndim == refs.ndim + 1:
        if preds.shape[-1] == 0:
            raise ValueError(f"logits of shape {preds.shape} have no classes")
        preds = preds.argmax(axis=-1)
    preds, refs = preds.reshape(-1), refs.reshape(-1)
    if preds.shape != refs.shape:
        raise ValueError(f"{preds.size} predictions but {refs.size} references")
    for what, values in (("predictions", preds), ("references", refs)):
        if values.size and not (np.all(np.isfinite(values)) and np.all(np.equal(np.mod(values, 1), 0))):
            raise ValueError(f"{what} must be class ids (integers) or logits, got e.g. {values[0]!r}")
        if values.size and values.dtype.kind == "f" and (values.min() < 0 or values.max() >= MAX_ID):
            raise ValueError(f"{what} must be class ids from 0 to {MAX_ID - 1}, got e.g. {values.max()!r}")
    preds, refs = preds.astype(np.int64), refs.astype(np.int64)
    if preds.size and min(preds.min(), refs.min()) < 0:
        raise ValueError("class ids must be 0 or more (drop ignored examples before adding them)")
    return preds, refs


class ConfusionMetric(Metric):
    """Counts each (true class, predicted class) pair seen: memory grows with the pairs present (at most classes²,
    and never more than the examples added), not with the largest class id."""

    def __init__(self, num_classes: int = 0) -> None:
        self.num_classes = num_classes  # a hint kept for callers; the counts are sized by the classes present
        super().__init__()

    def reset(self) -> None:
        self.pairs = np.zeros((0, 2), dtype=np.int64)  # distinct (true, predicted) pairs, sorted
        self.counts = np.zeros(0, dtype=np.int64)  # how often each pair was seen

    def add_batch(self, *, predictions: Any, references: Any) -> None:
        preds, refs = class_ids(predictions, references)
        if not preds.size:
            return
        pairs = np.concatenate([self.pairs, np.stack([refs, preds], axis=1)])
        weights = np.concatenate([self.counts, np.ones(len(refs), dtype=np.int64)])
        self.pairs, inverse = np.unique(pairs, axis=0, return_inverse=True)
        self.counts = np.zeros(len(self.pairs), dtype=np.int64)
        np.add.at(self.counts, inverse.reshape(-1), weights)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def per_class(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(classes present in either role, sorted; their true counts; predicted counts; correct counts)."""
        classes = np.unique(self.pairs)
        true_at = np.searchsorted(classes, self.pairs[:, 0])
        predicted_at = np.searchsorted(classes, self.pairs[:, 1])
        size = len(classes)
        true = np.bincount(true_at, weights=self.counts, minlength=size)
        predicted = np.bincount(predicted_at, weights=self.counts, minlength=size)
        hit = true_at == predicted_at
        correct = np.bincount(true_at[hit], weights=self.counts[hit], minlength=size)
        return classes, true, predicted, correct


class Accuracy(ConfusionMetric):
    """Share of examples whose predicted class is the true one (``normalize=False``: their number)."""

    name = "accuracy"

    def __init__(self, normalize: bool = True, num_classes: int = 0) -> None:
        self.normalize = normalize
        super().__init__(num_classes)

    def _result(self) -> dict[str, float]:
        correct = float(self.counts[self.pairs[:, 0] == self.pairs[:, 1]].sum())
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
        super().__init__(num_classes)

    @staticmethod
    def _score(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _result(self) -> dict[str, float]:
        if not self.total:
            return {self.name: float("nan")}
        classes, true, predicted, correct = self.per_class()
        present = [int(c) for c in classes]
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
        at = np.searchsorted(classes, chosen)
        seen = np.isin(chosen, classes)  # a class never seen has all counts 0
        at = np.where(seen, np.minimum(at, len(classes) - 1), 0)
        tp, support, guessed = (np.where(seen, values[at], 0.0) for values in (correct, true, predicted))
        fp, fn = guessed - tp, support - tp
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
        _, true, predicted, correct = self.per_class()
        correct, samples = correct.sum(), true.sum()
        covariance = correct * samples - true @ predicted
        denominator = np.sqrt((samples**2 - predicted @ predicted) * (samples**2 - true @ true))
        return {self.name: float(covariance / denominator) if denominator else 0.0}
