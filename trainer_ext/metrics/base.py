"""The metric protocol shared by every metric here: ``evaluate``'s ``add_batch`` / ``compute`` with bounded state."""

from __future__ import annotations

from typing import Any

import numpy as np


class Metric:
    """A streaming metric: ``add_batch`` folds a batch into running counts, ``compute`` reads and resets them.

    ``compute(predictions=..., references=...)`` adds that last batch first, as ``evaluate`` does; the state is a few
    counts, never the predictions themselves, so memory does not grow with the evaluation set.
    """

    name: str = ""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything added so far."""
        raise NotImplementedError

    def add_batch(self, *, predictions: Any, references: Any) -> None:
        """Fold one batch of predictions and their references into the running counts."""
        raise NotImplementedError

    def add(self, *, prediction: Any, reference: Any) -> None:
        """Fold one example (``evaluate``'s ``add``)."""
        self.add_batch(predictions=[prediction], references=[reference])

    def _result(self) -> dict[str, float]:
        raise NotImplementedError

    def compute(self, *, predictions: Any = None, references: Any = None) -> dict[str, float]:
        """The metric over everything added (plus ``predictions``/``references`` if given); then the state resets."""
        if (predictions is None) != (references is None):
            raise ValueError(f"{self.name}: pass both predictions and references, or neither")
        if predictions is not None:
            self.add_batch(predictions=predictions, references=references)
        try:
            return self._result()
        finally:
            self.reset()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def to_numpy(values: Any) -> np.ndarray:
    """A numpy array from a list, an array or a torch tensor (any device; half precision becomes float32)."""
    if hasattr(values, "detach"):  # torch.Tensor, without importing torch
        values = values.detach()
        if values.is_floating_point() and values.element_size() < 4:
            values = values.float()
        return values.cpu().numpy()
    return np.asarray(values)
