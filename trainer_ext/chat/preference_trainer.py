"""``PreferenceTrainer``: DPO (sigmoid, IPO, reference-free) and SimPO on trainer_ext's ``Trainer``.

The step is TRL's ``DPOTrainer``'s (TRL 1.16): chosen and rejected sequences of a batch of pairs run through the
policy as one batch (chosen rows first), each sequence's log-probability is the sum of its response tokens'
log-probabilities (SimPO: their mean), the reference log-probabilities come from the reference model under
``no_grad``, and the loss is the mean over the pairs. The metrics TRL logs — ``rewards/chosen``,
``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``,
``logits/chosen``, ``logits/rejected`` — are gathered over the data-parallel ranks at each micro-batch and averaged
over the logging window (``eval_`` prefixed in evaluation).

The reference: ``ref_model`` when given (moved to the training device, in eval mode, frozen; never wrapped for
data parallelism, never saved in checkpoints); for a PEFT model without one, the model itself with its adapters
disabled; none for ``reference_free`` (reference log-probabilities 0) and for SimPO.

Evaluation: the loss is a mean over pairs, so ``exact_eval_loss`` counts pairs (a batch holds no ``labels``:
trainer_ext's exact evaluation takes its samples as the units) and ``eval_loss`` is the exact mean over every pair;
``compute_metrics`` receives ``(chosen_rewards, rejected_rewards)`` as predictions.
"""

from __future__ import annotations

from collections import defaultdict
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
from trainer_ext.trainer.trainer import Trainer


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
        self._preference_metrics: dict[str, dict[str, list[float]]] = {
            "train": defaultdict(list),
            "eval": defaultdict(list),
        }

    def _set_signature_columns_if_needed(self) -> None:
        """With ``remove_unused_columns``, the columns kept are the pairs' (the model's forward names none)."""
        if self._signature_columns is None:
            self._signature_columns = list(PREFERENCE_COLUMNS)

    def _reference_logits(self, model: Any, kwargs: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            if self.ref_model is not None:
                return self.ref_model(**kwargs).logits
            unwrapped = self.accelerator.unwrap_model(model)  # not through DDP: no gradients to reduce
            with unwrapped.disable_adapter():
                return unwrapped(**kwargs).logits

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
        logits = model(**kwargs).logits
        sums = sequence_logps(logits, labels)
        if self.loss_type == "simpo":
            scores = sums / (labels[:, 1:] != IGNORE_INDEX).sum(-1).clamp(min=1)
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
            if self.loss_type == "ipo":  # TRL: the scores averaged over the response tokens
                lengths = (labels != IGNORE_INDEX).sum(-1).clamp(min=1)
                policy_scores, ref_scores = sums / lengths, ref / lengths
            else:
                policy_scores, ref_scores = sums, ref
            chosen, rejected = policy_scores.split(pairs)
            ref_chosen, ref_rejected = ref_scores.split(pairs)
            losses = dpo_loss(
                chosen, rejected, ref_chosen, ref_rejected, self.beta, self.loss_type, self.label_smoothing
            )
            logratios = (sums - ref).detach()
            chosen_rewards, rejected_rewards = (self.beta * logratios).split(pairs)
        loss = losses.mean()
        self._record(
            mode, logits, labels, sums if self.loss_type != "simpo" else scores, chosen_rewards, rejected_rewards
        )
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss

    def _record(
        self,
        mode: str,
        logits: torch.Tensor,
        labels: torch.Tensor,
        logps: torch.Tensor,
        chosen_rewards: torch.Tensor,
        rejected_rewards: torch.Tensor,
    ) -> None:
        """This micro-batch's metrics, over every data-parallel rank (TRL's names and definitions)."""
        gather = self.accelerator.gather
        window = self._preference_metrics[mode]
        pairs = chosen_rewards.shape[0]
        with torch.no_grad():
            mask = labels[:, 1:] != IGNORE_INDEX
            token_logits = logits[:, :-1].detach().float().mean(-1) * mask  # the mean logit at each response token
            sums = torch.stack(
                [part.sum() for part in token_logits.split(pairs)] + [m.sum() for m in mask.split(pairs)]
            )
            sums = gather(sums.reshape(1, -1)).sum(0)
            rewards = torch.stack([chosen_rewards, rejected_rewards])
            rewards = gather(rewards.T.contiguous()).T  # gathered along the pairs
            logps = gather(torch.stack(logps.detach().split(pairs)).T.contiguous()).T
        chosen, rejected = rewards
        window["rewards/chosen"].append(chosen.mean().item())
        window["rewards/rejected"].append(rejected.mean().item())
        window["rewards/accuracies"].append((chosen > rejected).float().mean().item())
        window["rewards/margins"].append((chosen - rejected).mean().item())
        window["logps/chosen"].append(logps[0].mean().item())
        window["logps/rejected"].append(logps[1].mean().item())
        window["logits/chosen"].append((sums[0] / sums[2]).item() if sums[2] > 0 else 0.0)
        window["logits/rejected"].append((sums[1] / sums[3]).item() if sums[3] > 0 else 0.0)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add the window's averaged preference metrics (``eval_``-prefixed in evaluation), then empty the window."""
        mode = "train" if self.model.training else "eval"
        window = self._preference_metrics[mode]
        prefix = "eval_" if mode == "eval" else ""
        logs.update({f"{prefix}{key}": sum(values) / len(values) for key, values in window.items() if values})
        super().log(logs, *args, **kwargs)
        window.clear()
