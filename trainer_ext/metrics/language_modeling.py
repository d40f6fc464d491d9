"""Causal language-model metrics from logits and labels: perplexity and next-token accuracy.

As transformers' causal-LM loss does, the logits at position t predict the label at t + 1 (``shift=True``) and labels
equal to ``ignore_index`` (-100: padding, prompt tokens) count for nothing. The state is two or three running sums.
"""

from __future__ import annotations

import math
from typing import Any

from trainer_ext.metrics.base import Metric

IGNORE_INDEX = -100


def _tensor(values: Any) -> Any:
    """A torch tensor from a tensor (kept on its device), an array or a list."""
    import torch

    if isinstance(values, torch.Tensor):
        return values.detach()
    import numpy as np

    try:
        return torch.from_numpy(np.asarray(values))
    except (TypeError, ValueError) as error:  # strings, None, ragged lists
        raise ValueError(f"predictions and references must be arrays of numbers: {error}") from error


class _TokenMetric(Metric):
    """Aligns logits (or predicted ids) with labels: the causal shift, then a mask of the labels that count."""

    def __init__(self, shift: bool = True, ignore_index: int = IGNORE_INDEX) -> None:
        self.shift, self.ignore_index = shift, ignore_index
        super().__init__()

    def _aligned(self, predictions: Any, references: Any, need_logits: bool) -> tuple[Any, Any, Any]:
        """(predictions, labels, mask) with predictions at t facing the label at t + 1."""
        preds, labels = _tensor(predictions), _tensor(references).long()
        logits = preds.dim() == labels.dim() + 1
        if labels.dim() == 0 or (logits and preds.shape[-1] == 0):
            raise ValueError(
                f"{self.name}: got predictions {tuple(preds.shape)} and labels {tuple(labels.shape)}; labels need a "
                "sequence axis and logits a vocabulary of at least one token"
            )
        if need_logits and not logits:
            raise ValueError(
                f"{self.name} needs logits of shape (batch, sequence, vocabulary) beside labels of shape (batch, "
                f"sequence); got predictions {tuple(preds.shape)} and labels {tuple(labels.shape)}"
            )
        if tuple(preds.shape[: labels.dim()]) != tuple(labels.shape):
            raise ValueError(
                f"{self.name}: predictions {tuple(preds.shape)} do not match labels {tuple(labels.shape)}"
            )
        if self.shift:
            preds = preds[..., :-1, :] if logits else preds[..., :-1]
            labels = labels[..., 1:]
        labels = labels.to(preds.device)
        return preds, labels, labels != self.ignore_index


class Perplexity(_TokenMetric):
    """exp(mean negative log-likelihood per counted token), from summed NLL and token counts over every batch."""

    name = "perplexity"

    def reset(self) -> None:
        self.nll, self.tokens = 0.0, 0

    def add_batch(self, *, predictions: Any, references: Any) -> None:
        import torch

        logits, labels, mask = self._aligned(predictions, references, need_logits=True)
        counted, vocabulary = labels[mask], logits.shape[-1]
        outside = counted[(counted < 0) | (counted >= vocabulary)]
        if outside.numel():
            raise ValueError(
                f"{self.name}: label {int(outside[0])} is not a token id of the {vocabulary}-token vocabulary (nor "
                f"ignore_index {self.ignore_index})"
            )
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        self.nll += float(nll)
        self.tokens += int(mask.sum())

    def _result(self) -> dict[str, float]:
        if not self.tokens:
            return {self.name: float("nan")}
        mean = self.nll / self.tokens
        return {self.name: math.exp(mean) if mean < 709 else float("inf")}


class TokenAccuracy(_TokenMetric):
    """Share of counted tokens whose highest logit (or given predicted id) is the next token."""

    name = "accuracy"

    def reset(self) -> None:
        self.correct, self.tokens = 0, 0

    def add_batch(self, *, predictions: Any, references: Any) -> None:
        preds, labels, mask = self._aligned(predictions, references, need_logits=False)
        if preds.dim() == labels.dim() + 1:
            preds = preds.argmax(dim=-1)
        self.correct += int(((preds == labels) & mask).sum())
        self.tokens += int(mask.sum())

    def _result(self) -> dict[str, float]:
        return {self.name: self.correct / self.tokens if self.tokens else float("nan")}
