"""Exact evaluation loss: the mean over the loss's own units, the same for any world size and batch size.

transformers reports ``eval_loss`` as the mean of per-batch means (each batch's mean repeated once per sample), so
a token-averaged causal-LM loss changes with how sequences fall into batches, and the duplicated samples that
complete the last round of an uneven shard are dropped only after their batch's mean already mixed them in. With
``exact_eval_loss`` every batch adds ``loss × units`` and ``units`` (tokens whose label counts for a token loss,
samples for a per-sample loss), only for the samples that are real, and ``eval_loss`` is the ratio of the two sums
over all batches and ranks. transformers' own figure stays available as ``eval_batch_mean_loss``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trainer_ext.distributed import collectives
from trainer_ext.trainer import compat as _compat

IGNORE_INDEX = -100
BATCH_MEAN_LOSS = "batch_mean_loss"


def batch_rows(inputs: Any) -> int:
    """Samples in a batch: the leading size of its first tensor (0 when it holds none)."""
    values = inputs.values() if isinstance(inputs, Mapping) else inputs if isinstance(inputs, (list, tuple)) else []
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


def first_rows(inputs: Any, rows: int, count: int) -> Any:
    """The first ``count`` samples of a batch of ``rows``: every value whose leading size is ``rows`` is cut."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            return value[:count]
        if isinstance(value, list) and len(value) == rows:
            return value[:count]
        return value

    if isinstance(inputs, Mapping):
        return type(inputs)({key: cut(value) for key, value in inputs.items()})
    return type(inputs)(cut(value) for value in inputs)


def real_rows(accelerator: Any, rows: int) -> int:
    """How many of this rank's ``rows`` evaluation samples are real: all of them, except in the last round of an
    uneven shard, which is gathered in rank order with its first ``remainder`` samples real (as
    ``gather_for_metrics``) and the rest repeats that complete the round."""
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0 and rows > 0:
        return min(max(state.remainder - accelerator.data_parallel_index * rows, 0), rows)
    return rows


def loss_units(inputs: Any, shifts_labels: bool) -> torch.Tensor | int:
    """What a batch's mean loss is a mean over, as transformers' model losses define it.

    Integer ``labels``: the labels that are not -100 (``shift_labels`` when given, ``labels[..., 1:]`` for a
    loss that shifts them): tokens for token losses, samples for classification. Float ``labels`` (regression,
    multi-label): every element, as MSE and BCE average. No ``labels`` (a loss from other keys, such as QA's start
    and end positions, or a preference pair's): samples.
    """
    labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
    shifted = inputs.get("shift_labels") if isinstance(inputs, Mapping) else None
    if isinstance(shifted, torch.Tensor):
        return (shifted != IGNORE_INDEX).sum()
    if not isinstance(labels, torch.Tensor):
        return batch_rows(inputs)
    if torch.is_floating_point(labels):
        return labels.numel()
    if shifts_labels and labels.dim() >= 2:
        labels = labels[..., 1:]
    return (labels != IGNORE_INDEX).sum()


class ExactEvalLossMixin:
    """Trainer mixin: with ``args.exact_eval_loss``, ``eval_loss`` is the exact mean over the loss's units.

    Each batch's sum is recovered from the loss transformers computed: times ``num_items_in_batch`` (and undone
    ``average_tokens_across_devices`` scaling) when the loss was divided by it, times :meth:`eval_loss_units`
    otherwise. The duplicated samples that complete the last round of an uneven shard are left out: when the last
    batch of a rank mixes real and repeated samples, every rank runs one more forward pass on its real samples
    alone (every rank, so that sharded models' collectives stay in step); a rank whose last batch is all repeats
    adds nothing. One all-reduce at the end of the loop sums the ranks.
    """

    _exact_eval_sums: torch.Tensor | None = None  # [sum of losses, units] while an evaluation loop runs
    _exact_eval_items: Any = None  # the num_items_in_batch of the batch being predicted
    _exact_eval_shifts = False  # the model's loss predicts label i+1 at position i (see _compat.loss_shifts_labels)

    def _exact_eval_enabled(self) -> bool:
        return bool(getattr(self.args, "exact_eval_loss", False))

    def eval_loss_units(self, model: Any, inputs: Any) -> torch.Tensor | int:
        """Units of a batch's mean loss (see :func:`loss_units`); override for a loss with another definition."""
        return loss_units(inputs, self._exact_eval_shifts)

    def evaluation_loop(self, dataloader: Any, description: str, *args: Any, **kwargs: Any) -> Any:
        if not self._exact_eval_enabled():
            return super().evaluation_loop(dataloader, description, *args, **kwargs)
        self._exact_eval_sums = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        # not transformers' _loss_shifts_labels: it misses causal heads that name no loss type (GPT-2), whose
        # units would then count one label too many per row
        self._exact_eval_shifts = _compat.loss_shifts_labels(self.accelerator.unwrap_model(self.model))
        try:
            output = super().evaluation_loop(dataloader, description, *args, **kwargs)
            sums = self._exact_eval_sums
        finally:
            self._exact_eval_sums = self._exact_eval_items = None
        prefix = kwargs.get("metric_key_prefix", args[2] if len(args) > 2 else "eval")
        total, units = collectives.reduce(sums, "sum").tolist()
        metrics = output.metrics
        if units > 0:
            if f"{prefix}_loss" in metrics:
                metrics[f"{prefix}_{BATCH_MEAN_LOSS}"] = metrics[f"{prefix}_loss"]
            metrics[f"{prefix}_loss"] = total / units
        return output

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        items = super()._get_num_items_in_batch(batch_samples, device)
        if self._exact_eval_sums is not None:
            self._exact_eval_items = items
        return items

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, *args: Any, **kwargs: Any) -> Any:
        self._exact_eval_items = None
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, *args, **kwargs)
        if loss is not None and self._exact_eval_sums is not None:
            self._add_exact_eval(model, inputs, loss)
        return loss, logits, labels

    def _batch_sum(self, loss: torch.Tensor, units: Any, items: Any) -> torch.Tensor:
        """The sum of a batch's losses from the mean transformers returned for it."""
        loss = loss.detach().to(torch.float64)
        if items is None:
            return loss * units
        # compute_loss divided the sum by num_items_in_batch, then multiplied by the processes when those items
        # were counted over all of them (average_tokens_across_devices)
        # (over the processes that see different batches: num_processes // (tp × cp); a cp rank's loss is the sum
        # of its group's slices by then, see trainer.context_parallel)
        scale = self.accelerator.num_data_parallel_processes if self.args.average_tokens_across_devices else 1
        return loss * items / scale

    def _add_exact_eval(self, model: Any, inputs: Any, loss: torch.Tensor) -> None:
        rows = batch_rows(inputs)
        real, items = real_rows(self.accelerator, rows), self._exact_eval_items
        state = self.accelerator.gradient_state
        remainder = state.remainder
        if state.end_of_dataloader and remainder > 0 and rows > 0:
            if remainder % rows:  # some rank's last batch mixes real and repeated samples: all ranks run once more
                inputs = first_rows(inputs, rows, max(real, 1))
                units = self.eval_loss_units(model, inputs)  # before the loss, which may pop the labels
                with torch.no_grad(), self.compute_loss_context_manager():
                    loss = self.compute_loss(model, self._prepare_inputs(inputs)).mean()
                if real > 0:
                    self._accumulate(self._batch_sum(loss, units, None), units)
                return
        if real > 0:
            units = self.eval_loss_units(model, inputs)
            self._accumulate(self._batch_sum(loss, units, items), units)

    def _accumulate(self, total: torch.Tensor, units: Any) -> None:
        units = torch.as_tensor(units, dtype=torch.float64, device=total.device)
        total = torch.where(units > 0, total, torch.zeros_like(total))  # a batch of -100 labels has a NaN mean
        self._exact_eval_sums += torch.stack([total, units]).to(self._exact_eval_sums.device)
