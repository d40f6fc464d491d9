"""``PreferenceTrainer``: DPO (sigmoid, IPO, reference-free) and SimPO on trainer_ext's ``Trainer``.

The step is TRL's ``DPOTrainer``'s (TRL 1.16): chosen and rejected sequences of a batch of pairs run through the
policy as one batch (chosen rows first), each sequence's log-probability is the sum of its response tokens'
log-probabilities (SimPO: their mean), the reference log-probabilities come from the reference model under
``no_grad``, and the loss is the mean over the pairs. The metrics TRL logs — ``rewards/chosen``,
``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``,
``logits/chosen``, ``logits/rejected`` — are summed on each rank over the logging window and reduced over the
data-parallel ranks once, when logged: the means over the window's pairs (logits/*: over its response tokens),
``eval_`` prefixed in evaluation, where the pairs the sampler repeats to complete the last round are left out. The
rewards and logps/* come from the summed log-probabilities under ipo too, as TRL logs them. The reference forward
runs under the accelerator's autocast, as the policy's does.

The reference: ``ref_model`` when given (moved to the training device, in eval mode, frozen; never wrapped for
data parallelism, never saved in checkpoints); for a PEFT model without one, the model itself with its adapters
disabled; none for ``reference_free`` (reference log-probabilities 0) and for SimPO.

Evaluation: the loss is a mean over pairs, so ``exact_eval_loss`` counts pairs (a batch holds no ``labels``:
trainer_ext's exact evaluation takes its samples as the units) and ``eval_loss`` is the exact mean over every pair;
``compute_metrics`` receives ``(chosen_rewards, rejected_rewards)`` as predictions.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_ext.chat.preference import (
    IGNORE_INDEX,
    LOSS_TYPES,
    PREFERENCE_COLUMNS,
    PreferenceCollator,
    dpo_loss,
    sequence_logps,
    simpo_loss,
)
from trainer_ext.errors import ConfigError
from trainer_ext.trainer.exact_eval import real_rows
from trainer_ext.trainer.trainer import Trainer

# the logged metrics (TRL's names); the first six are means over pairs, the logits/* means over response tokens
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
)


def _is_peft_model(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and getattr(model, "peft_config", None) is not None


def _disable_dropout(model: torch.nn.Module) -> None:
    """As TRL's ``disable_dropout_in_model``: every ``nn.Dropout`` gets p = 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


class PreferenceTrainer(Trainer):
    """trainer_ext's ``Trainer`` for preference pairs (rows of :func:`~trainer_ext.chat.preference.encode_preference`).

    Keyword-only, besides ``Trainer``'s arguments: ``ref_model`` (the frozen reference; required unless the model is
    a PEFT model, ``reference_free`` is set or ``loss_type`` is ``simpo``), ``beta`` (β), ``loss_type`` (``sigmoid``,
    ``ipo`` or ``simpo``), ``reference_free``, ``simpo_gamma`` (SimPO's γ), ``label_smoothing`` (conservative DPO,
    sigmoid only) and ``disable_dropout`` (TRL's default: dropout off in the policy and the reference).
    The default collator is :class:`~trainer_ext.chat.preference.PreferenceCollator` with the tokenizer's pad token
    (its eos token when it has none, as TRL).
    """

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *,
        ref_model: torch.nn.Module | None = None,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        reference_free: bool = False,
        simpo_gamma: float = 0.5,
        label_smoothing: float = 0.0,
        disable_dropout: bool = True,
        **kwargs: Any,
    ) -> None:
        if loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
        if beta <= 0:
            raise ConfigError(f"beta must be positive, got {beta}")
        if ref_model is not None and ref_model is model:
            raise ConfigError("ref_model is the model being trained; pass a frozen copy of it, or none under LoRA")
        if loss_type == "simpo" and ref_model is not None:
            raise ConfigError("SimPO uses no reference model; leave ref_model unset for loss_type simpo")
        self.beta, self.loss_type, self.simpo_gamma = beta, loss_type, simpo_gamma
        self.label_smoothing = label_smoothing
        self.reference_free = reference_free or loss_type == "simpo"
        if not self.reference_free and ref_model is None and not _is_peft_model(model):
            raise ConfigError(
                "preference training needs a reference model: pass ref_model (a frozen copy of the initial model), "
                "train a LoRA adapter (the reference is the model with its adapters disabled), or set "
                "reference_free=True"
            )
        if disable_dropout:
            for module in (model, ref_model):
                if module is not None:
                    _disable_dropout(module)
        if kwargs.get("data_collator") is None:
            tokenizer = kwargs.get("processing_class")
            tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
            pad = None if tokenizer is None else tokenizer.pad_token_id
            pad = tokenizer.eos_token_id if pad is None and tokenizer is not None else pad
            if pad is None:
                raise ConfigError("pass processing_class (a tokenizer with a pad or eos token) or a data_collator")
            kwargs["data_collator"] = PreferenceCollator(pad)
        super().__init__(model=model, args=args, **kwargs)
        # no labels: transformers' evaluation computes the loss through compute_loss (can_return_loss) and exact
        # evaluation counts pairs
        self.label_names, self.can_return_loss = [], True
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.requires_grad_(False)
            self.ref_model = ref_model.to(self.args.device).eval()
        # per mode, this rank's [sums of METRICS..., their counts] since the last log (None: nothing recorded)
        self._preference_metrics: dict[str, torch.Tensor | None] = {"train": None, "eval": None}
        self._record_eval = False  # set by prediction_step for its first compute_loss (not exact eval's rerun)

    def _set_signature_columns_if_needed(self) -> None:
        """With ``remove_unused_columns``, the columns kept are the pairs' (the model's forward names none)."""
        if self._signature_columns is None:
            self._signature_columns = list(PREFERENCE_COLUMNS)

    def _reference_logits(self, model: Any, kwargs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's logits, in the policy's precision: under the accelerator's autocast (the prepared
        policy's forward runs under it for --bf16/--fp16), half-precision logits back as float32 as the policy's."""
        with torch.no_grad(), self.accelerator.autocast():
            if self.ref_model is not None:
                logits = self.ref_model(**kwargs).logits
            else:
                unwrapped = self.accelerator.unwrap_model(model)  # not through DDP: no gradients to reduce
                with unwrapped.disable_adapter():  # the prepared model's own forward: autocast, float32 logits
                    logits = unwrapped(**kwargs).logits
        if self.accelerator.mixed_precision != "no" and logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return logits

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, *args: Any, **kwargs: Any) -> Any:
        """Records the batch's metrics in its first ``compute_loss`` only (exact evaluation may run the batch's
        real pairs once more)."""
        self._record_eval = True
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, *args, **kwargs)
        finally:
            self._record_eval = False

    def compute_loss(
        self, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        mode = "train" if self.model.training else "eval"
        pairs = inputs["chosen_input_ids"].shape[0]
        kwargs = {
            "input_ids": torch.cat([inputs["chosen_input_ids"], inputs["rejected_input_ids"]]),
            "attention_mask": torch.cat([inputs["chosen_attention_mask"], inputs["rejected_attention_mask"]]),
            "use_cache": False,
        }
        labels = torch.cat([inputs["chosen_labels"], inputs["rejected_labels"]])
        # response tokens whose log-probability counts (position t predicts label t + 1), for SimPO and IPO
        lengths = (labels[:, 1:] != IGNORE_INDEX).sum(-1).clamp(min=1)
        logits = model(**kwargs).logits
        sums = sequence_logps(logits, labels)
        if self.loss_type == "simpo":
            scores = sums / lengths
            chosen, rejected = scores.split(pairs)
            losses = simpo_loss(chosen, rejected, self.beta, self.simpo_gamma)
            chosen_rewards, rejected_rewards = self.beta * chosen.detach(), self.beta * rejected.detach()
        else:
            ref = (
                torch.zeros_like(sums)
                if self.reference_free
                else sequence_logps(self._reference_logits(model, kwargs), labels)
            )
            ref = ref.detach()
            if self.loss_type == "ipo":  # TRL: the loss on the scores averaged over the response tokens
                policy_scores, ref_scores = sums / lengths, ref / lengths
            else:
                policy_scores, ref_scores = sums, ref
            chosen, rejected = policy_scores.split(pairs)
            ref_chosen, ref_rejected = ref_scores.split(pairs)
            losses = dpo_loss(
                chosen, rejected, ref_chosen, ref_rejected, self.beta, self.loss_type, self.label_smoothing
            )
            # the rewards and logps/* from the summed log-probabilities, also under ipo (as TRL 1.16 logs them)
            logratios = (sums - ref).detach()
            chosen_rewards, rejected_rewards = (self.beta * logratios).split(pairs)
        loss = losses.mean()
        if mode == "train" or self._record_eval:
            self._record_eval = False
            real = pairs if mode == "train" else real_rows(self.accelerator, pairs)  # not the eval sampler's repeats
            logps = sums if self.loss_type != "simpo" else scores
            self._record(mode, real, logits, labels, logps, chosen_rewards, rejected_rewards)
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss

    def _record(
        self,
        mode: str,
        real: int,
        logits: torch.Tensor,
        labels: torch.Tensor,
        logps: torch.Tensor,
        chosen_rewards: torch.Tensor,
        rejected_rewards: torch.Tensor,
    ) -> None:
        """Add this micro-batch's first ``real`` pairs to this rank's metric sums (TRL's definitions); no collective
        here: :meth:`log` sums the ranks."""
        pairs = chosen_rewards.shape[0]
        with torch.no_grad():
            mask = labels[:, 1:] != IGNORE_INDEX
            token_logits = logits[:, :-1].detach().mean(-1, dtype=torch.float32) * mask  # mean logit per token
            chosen, rejected = chosen_rewards[:real].double(), rejected_rewards[:real].double()
            logps_chosen, logps_rejected = (part[:real].double() for part in logps.detach().split(pairs))
            (logits_chosen, logits_rejected), (mask_chosen, mask_rejected) = (
                token_logits.split(pairs),
                mask.split(pairs),
            )
            sums = [
                chosen.sum(),
                rejected.sum(),
                (chosen > rejected).sum(),
                (chosen - rejected).sum(),
                logps_chosen.sum(),
                logps_rejected.sum(),
                logits_chosen[:real].sum(),
                logits_rejected[:real].sum(),
            ]
            counts = [torch.tensor(real, device=chosen.device)] * 6 + [
                mask_chosen[:real].sum(),
                mask_rejected[:real].sum(),
            ]
            update = torch.stack([value.to(torch.float64) for value in sums + counts])
        held = self._preference_metrics[mode]
        self._preference_metrics[mode] = update if held is None else held + update

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add the preference metrics since the last log, over every rank (one all-reduce; ``eval_``-prefixed in
        evaluation): the means over the window's pairs, the logits/* over its response tokens."""
        mode = "train" if self.model.training else "eval"
        held = self._preference_metrics[mode]
        if held is not None:  # every rank records the same micro-batches, so every rank reduces here
            self._preference_metrics[mode] = None
            totals = self.accelerator.reduce(held, "sum").tolist()
            sums, counts = totals[: len(METRICS)], totals[len(METRICS) :]
            prefix = "eval_" if mode == "eval" else ""
            if counts[0] > 0:
                for name, total, count in zip(METRICS, sums, counts, strict=True):
                    logs[f"{prefix}{name}"] = total / count if count > 0 else 0.0
        super().log(logs, *args, **kwargs)
