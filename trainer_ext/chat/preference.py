"""Preference pairs for DPO-style training: tokenising prompt/chosen/rejected rows, the collator, the losses.

The tokenisation is TRL's ``DPOTrainer``'s (TRL 1.16): a conversational row (message lists) is rendered by the chat
template, the prompt with the generation prompt and prompt + chosen / prompt + rejected as whole conversations; a
plain row (strings) gets the tokenizer's eos text appended to chosen and rejected when missing and is tokenized
as ``tokenizer(text=...)`` (special tokens as the tokenizer adds them). The response starts where the tokenized
prompt and prompt + response first differ. A row without a ``prompt`` has its shared prefix taken as the prompt
(TRL's ``extract_prompt``). Over-long pairs are handled as TRL by default (``truncation_mode="keep_start"``): a pair
whose prompt alone fills ``max_seq_length`` tokens is dropped, the others keep their first ``max_seq_length``
tokens of prompt + response. TRL cuts in its collator and drops silently; here the cut is made once, when
encoding, and one warning line counts the pairs cut and dropped. A pair whose tokenized prompt is empty (chosen and
rejected differ from their first token, and the tokenizer adds no bos) is dropped, with one warning line counting
them: no logit predicts its first response token. TRL keeps such a pair, without that token in its log-probability
but with it in IPO's length normalisation.

``chosen_input_ids`` and ``rejected_input_ids`` hold the response tokens only (TRL's ``chosen_ids`` and
``rejected_ids``); a sequence is ``prompt_input_ids + chosen_input_ids``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from trainer_ext.chat.encode import common_prefix_length
from trainer_ext.chat.formats import extract_prompt as extract_prompt
from trainer_ext.chat.names import IGNORE_INDEX as IGNORE_INDEX
from trainer_ext.chat.names import LOSS_TYPES as LOSS_TYPES
from trainer_ext.chat.templates import render_ids
from trainer_ext.errors import ConfigError

logger = logging.getLogger(__name__)

PREFERENCE_COLUMNS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")


def _is_messages(value: Any) -> bool:
    """A list of messages (dicts with a ``role``), as TRL's ``is_conversational`` tests."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping) and "role" in value[0]


def _row_ids(row: Mapping, index: int, tokenizer: Any, template: str | None, source: str) -> tuple[list[int], ...]:
    """(prompt ids, prompt + chosen ids, prompt + rejected ids) of one row, as TRL tokenizes it."""
    for key in ("chosen", "rejected"):
        if key not in row or row[key] is None:
            raise ConfigError(f"{source}: preference row {index} has no '{key}'; every row needs chosen and rejected")
    chosen, rejected = row["chosen"], row["rejected"]
    prompt = row.get("prompt")
    if prompt is None or _is_messages(prompt) != _is_messages(chosen):
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    conversational = _is_messages(chosen)
    if conversational:
        consistent = _is_messages(rejected) and isinstance(prompt, list)
    else:
        consistent = all(isinstance(value, str) for value in (prompt, chosen, rejected))
    if not consistent:
        raise ConfigError(
            f"{source}: preference row {index} mixes message lists and strings in prompt/chosen/rejected; give all "
            "three as message lists (role, content) or all three as strings"
        )
    if conversational:
        if template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(
                f"{source}: conversational preference rows need a chat template and the tokenizer has none; pass "
                "--chat_template (chatml, llama-3, mistral, qwen or a .jinja file)"
            )
        return (
            render_ids(tokenizer, prompt, template, add_generation_prompt=True),
            render_ids(tokenizer, prompt + chosen, template),
            render_ids(tokenizer, prompt + rejected, template),
        )
    eos = tokenizer.eos_token
    if eos is None:
        raise ConfigError(f"{source}: the tokenizer has no eos token, which plain-text preference responses end with")
    chosen = chosen if chosen.endswith(eos) else chosen + eos
    rejected = rejected if rejected.endswith(eos) else rejected + eos
    return tuple(list(tokenizer(text=text)["input_ids"]) for text in (prompt, prompt + chosen, prompt + rejected))


def encode_preference(dataset: Any, tokenizer: Any, template: str | None, max_seq_length: int, source: str) -> Any:
    """Tokenize preference rows into ``prompt_input_ids``, ``chosen_input_ids``, ``rejected_input_ids``.

    ``dataset``: a ``datasets.Dataset`` (or any iterable of mappings) with ``prompt``/``chosen``/``rejected`` (message
    lists or strings; without ``prompt``, the shared prefix is the prompt). ``template``: a Jinja chat template for
    conversational rows, ``None`` for the tokenizer's own. ``source`` names the data in messages. Returns a
    ``datasets.Dataset``; see the module docstring for the exact rules (TRL's).
    """
    from datasets import Dataset

    if max_seq_length < 1:
        raise ConfigError(f"max_seq_length must be at least 1 for preference pairs, got {max_seq_length}")
    columns: dict[str, list[list[int]]] = {name: [] for name in PREFERENCE_COLUMNS}
    total = cut = dropped = diverged = no_prompt = 0
    for index, row in enumerate(_rows(dataset, source)):
        total += 1
        prompt_ids, chosen_ids, rejected_ids = _row_ids(row, index, tokenizer, template, source)
        prompt_len = min(common_prefix_length(prompt_ids, chosen_ids), common_prefix_length(prompt_ids, rejected_ids))
        diverged += prompt_len < len(prompt_ids)
        prompt, chosen, rejected = prompt_ids[:prompt_len], chosen_ids[prompt_len:], rejected_ids[prompt_len:]
        if not prompt:  # nothing precedes the first response token, which no logit then predicts
            no_prompt += 1
            continue
        if len(prompt) >= max_seq_length:
            dropped += 1
            continue
        room = max_seq_length - len(prompt)
        if len(chosen) > room or len(rejected) > room:
            cut += 1
            chosen, rejected = chosen[:room], rejected[:room]
        columns["prompt_input_ids"].append(prompt)
        columns["chosen_input_ids"].append(chosen)
        columns["rejected_input_ids"].append(rejected)
    if total == 0:
        raise ConfigError(f"{source}: no preference rows to train on")
    if diverged:
        logger.warning(
            f"{source}: in {diverged} of {total} preference pairs the tokenized prompt is not a prefix of prompt + "
            "response (the chat template renders the prompt alone differently, or tokens merge across the boundary); "
            "the response starts where they differ, as in TRL"
        )
    if cut or dropped:
        logger.warning(
            f"{source}: {cut + dropped} of {total} preference pairs longer than {max_seq_length} tokens: {cut} cut to "
            f"their first {max_seq_length} tokens of prompt + response, {dropped} dropped (the prompt alone fills "
            f"{max_seq_length} tokens), as TRL's keep_start truncation; raise --max_seq_length to keep them whole"
        )
    if no_prompt:
        logger.warning(
            f"{source}: {no_prompt} of {total} preference pairs dropped with an empty tokenized prompt (no token "
            "precedes the response, so its first token cannot be predicted); give each pair a prompt"
        )
    if dropped + no_prompt == total:
        raise ConfigError(
            f"{source}: no preference pair left to train on: {dropped} of {total} have a prompt that fills "
            f"max_seq_length ({max_seq_length} tokens), raise --max_seq_length; {no_prompt} have an empty prompt, "
            "give each pair a prompt"
        )
    return Dataset.from_dict(columns)


def _rows(dataset: Any, source: str) -> Iterable[Mapping]:
    names = getattr(dataset, "column_names", None)
    if names is not None and not {"chosen", "rejected"} <= set(names):
        raise ConfigError(
            f"{source}: preference data needs 'chosen' and 'rejected' columns (and optionally 'prompt'); columns: "
            f"{', '.join(names)}; pass --data_format preference and --column_mapping, e.g. "
            "--column_mapping chosen=good,rejected=bad"
        )
    return dataset


class PreferenceCollator:
    """Pads preference pairs into one batch of pairs (right padding).

    Each example holds ``prompt_input_ids``, ``chosen_input_ids`` and ``rejected_input_ids`` (other keys are
    ignored). The batch holds ``chosen_input_ids``/``rejected_input_ids`` (prompt + response),
    ``chosen_attention_mask``/``rejected_attention_mask`` and ``chosen_labels``/``rejected_labels`` (the token ids on
    the response, -100 on the prompt and the padding), all ``(pairs, length)`` with one length for chosen and
    rejected, so that the trainer runs both in one forward pass of ``2 × pairs`` rows as TRL does (TRL's collator
    stacks them; keeping pairs as rows lets exact evaluation count and cut pairs).
    """

    def __init__(self, pad_token_id: int) -> None:
        if pad_token_id is None:
            raise ConfigError(
                "PreferenceCollator needs a pad_token_id to pad preference pairs with, got None; pass the "
                "tokenizer's pad token id (or its eos token id when it has no pad token)"
            )
        self.pad_token_id = int(pad_token_id)

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        sequences = {"chosen": [], "rejected": []}
        prompts = [list(example["prompt_input_ids"]) for example in examples]
        for side in sequences:
            sequences[side] = [p + list(e[f"{side}_input_ids"]) for p, e in zip(prompts, examples, strict=True)]
        width = max(len(s) for side in sequences.values() for s in side)
        batch: dict[str, torch.Tensor] = {}
        for side, rows in sequences.items():
            ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
            for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
                ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
                mask[i, : len(row)] = 1
                labels[i, len(prompt) : len(row)] = ids[i, len(prompt) : len(row)]
            batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"] = ids, mask
            batch[f"{side}_labels"] = labels
        return batch


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per-sequence sum (``average``: mean) of the log-probabilities of ``labels`` (-100 ignored) under ``logits``.

    Position ``t`` predicts label ``t + 1``. float32/float64 logits: the label's logit minus the row's logsumexp (as
    TRL's ``selective_log_softmax``); lower precisions go through ``log_softmax`` in float32.
    """
    labels = labels[:, 1:]
    logits = logits[:, :-1]
    mask = labels != IGNORE_INDEX
    index = labels.masked_fill(~mask, 0).unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, index).squeeze(-1)
        per_token = picked - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    else:
        per_token = torch.stack(
            [
                F.log_softmax(row.float(), dim=-1).gather(-1, idx).squeeze(-1)
                for row, idx in zip(logits, index, strict=True)
            ]
        )
    total = (per_token * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | float,
    ref_rejected_logps: torch.Tensor | float,
    beta: float,
    loss_type: str,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-pair DPO losses (not reduced).

    ``sigmoid``: ``-(1 - ε) logσ(β Δ) - ε logσ(-β Δ)`` with ``Δ = (π_c - ref_c) - (π_r - ref_r)`` and ``ε`` the label
    smoothing (conservative DPO; ``ε = 0`` is TRL 1.16's ``sigmoid``). ``ipo``: ``(Δ - 1/(2β))²``; TRL normalises IPO
    by the response length, so pass per-token average log-probs (policy and reference) for TRL's figures.
    Reference-free DPO: reference log-probs 0.
    """
    if loss_type not in ("sigmoid", "ipo"):
        raise ConfigError(f"dpo_loss: loss_type must be sigmoid or ipo, got {loss_type!r} (simpo: simpo_loss)")
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")
    if loss_type == "ipo" and label_smoothing:
        raise ConfigError("label_smoothing applies to the sigmoid loss only; set it to 0 for ipo")
    delta = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    if loss_type == "ipo":
        return (delta - 1 / (2 * beta)) ** 2
    losses = -F.logsigmoid(beta * delta)
    if label_smoothing:
        losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-beta * delta)
    return losses


def simpo_loss(
    chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, beta: float, gamma: float
) -> torch.Tensor:
    """Per-pair SimPO losses (not reduced): ``-logσ(β (avg_c - avg_r) - γ)`` on per-token average log-probs (SimPO's
    Eq. 6; TRL's CPOTrainer ``loss_type="simpo"`` with ``cpo_alpha=0``). Reference-free."""
    return -F.logsigmoid(beta * (chosen_avg_logps - rejected_avg_logps) - gamma)
