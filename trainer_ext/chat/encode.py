"""Tokenising canonical SFT rows into ``input_ids`` and ``labels`` (-100 where no loss), as TRL's SFTTrainer does.

- messages: rendered by the chat template; with ``assistant_only_loss`` the labels keep the assistant answers and
  their end-of-turn tokens only (``templates.assistant_mask``), else every token.
- prompt/completion strings: the tokenizer's eos appended to the completion unless it ends with it;
  ``ids = tokenizer(prompt + completion)``, the completion starting where ``tokenizer(prompt)`` and ``ids`` diverge;
  with ``assistant_only_loss`` the labels keep the completion only.
- text: eos appended likewise, ``tokenizer(text)``, loss on every token.

Rows longer than ``max_seq_length`` follow ``truncation``: turns (the longest prefix of whole turns ending with an
assistant turn that fits; a row with none is dropped; text is cut), drop, error (one ConfigError naming the row) or
cut (the first ``max_seq_length`` tokens, as TRL; a row the cut leaves without a label counts as too long and
dropped). Rows without a label are dropped. One warning line per call
says how many rows were shortened or dropped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from trainer_ext.chat.names import IGNORE_INDEX, TRUNCATIONS
from trainer_ext.chat.templates import BUILTIN_TEMPLATES, assistant_mask
from trainer_ext.errors import ConfigError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

KEPT, TRUNCATED, DROPPED_LONG, DROPPED_NO_LABELS = "kept", "truncated", "dropped_long", "dropped_no_labels"
NOUNS = {"messages": "conversations", "prompt-completion": "prompt-completion rows", "text": "texts"}


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """How many leading tokens ``ids`` and ``other`` share (TRL's ``common_prefix_length``)."""
    length = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        length += 1
    return length


def _with_eos(text: str, tokenizer: PreTrainedTokenizerBase) -> str:
    eos = tokenizer.eos_token
    return text + eos if eos and not text.endswith(eos) else text


def _turn_ends(mask: list[int]) -> list[int]:
    """The end (exclusive) of each run of 1s in ``mask``: where each assistant turn ends."""
    return [i + 1 for i, bit in enumerate(mask) if bit and (i + 1 == len(mask) or not mask[i + 1])]


def _row_kind(columns: list[str]) -> str:
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt-completion"
    if "text" in columns:
        return "text"
    raise ConfigError(f"chat rows need a messages, prompt/completion or text column, not {', '.join(columns)}")


class _Encoder:
    """Tokenises one row (a datasets.map function) and applies the truncation policy."""

    def __init__(self, tokenizer, template, max_seq_length, assistant_only_loss, truncation, source, kind) -> None:
        self.tokenizer, self.template, self.max = tokenizer, template, max_seq_length
        self.assistant_only_loss, self.truncation, self.source, self.kind = (
            assistant_only_loss,
            truncation,
            source,
            kind,
        )

    def _messages(self, messages: list[dict[str, str]], index: int, need_mask: bool) -> tuple[list, list | None]:
        import jinja2

        try:
            if need_mask:
                return assistant_mask(self.tokenizer, messages, self.template)
            out = self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=True, return_dict=True
            )
            return list(out["input_ids"]), None
        except jinja2.TemplateError as error:
            reason = " ".join(str(error).split())
            raise ConfigError(f"{self.source!r} row {index}: the chat template cannot render it: {reason}") from error

    def _tokens(self, row: dict, index: int) -> tuple[list[int], list[int] | None]:
        """(input_ids, mask): mask 1 on assistant/completion tokens; None for text (every token learnt)."""
        tokenizer = self.tokenizer
        if self.kind == "messages":
            return self._messages(row["messages"], index, self.assistant_only_loss)
        if self.kind == "prompt-completion":
            completion = _with_eos(row["completion"], tokenizer)
            prompt_ids = tokenizer(row["prompt"])["input_ids"]
            ids = list(tokenizer(row["prompt"] + completion)["input_ids"])
            start = common_prefix_length(prompt_ids, ids)
            return ids, [0] * start + [1] * (len(ids) - start)
        return list(tokenizer(_with_eos(row["text"], tokenizer))["input_ids"]), None

    def _turns_end(self, row: dict, index: int, ids: list[int], mask: list[int] | None) -> tuple[int, int]:
        """(tokens kept, whole assistant turns kept) under --chat_truncation turns; (0, 0): drop the row."""
        if self.kind == "text":
            return self.max, 0
        if mask is None:  # messages without assistant-only loss: the turns still come from the mask
            try:
                marked, mask = self._messages(row["messages"], index, True)
            except ConfigError as error:
                raise ConfigError(
                    f"{self.source!r} row {index} is {len(ids)} tokens, longer than --max_seq_length {self.max}, "
                    f"and {str(error).split(';')[0]}; pass --chat_truncation cut or drop, or --chat_template with a "
                    f"built-in ({', '.join(BUILTIN_TEMPLATES)})"
                ) from error
            if marked != ids:
                mask = None
        ends = [end for end in _turn_ends(mask or []) if end <= self.max]
        return (ends[-1], len(ends)) if ends else (0, 0)

    def __call__(self, row: dict, index: int) -> dict[str, Any]:
        ids, mask = self._tokens(row, index)
        masked = self.assistant_only_loss and mask is not None
        labels = [t if bit else IGNORE_INDEX for t, bit in zip(ids, mask, strict=True)] if masked else list(ids)
        status, turns = KEPT, 0
        if len(ids) > self.max:
            if self.truncation == "error":
                raise ConfigError(
                    f"{self.source!r} row {index} is {len(ids)} tokens, longer than --max_seq_length {self.max}; "
                    "raise --max_seq_length, or pass --chat_truncation turns, drop or cut"
                )
            keep = self.max
            if self.truncation == "turns":
                keep, turns = self._turns_end(row, index, ids, mask)
            if self.truncation == "drop" or keep == 0:
                return {"input_ids": [], "labels": [], "_status": DROPPED_LONG, "_turns": 0}
            ids, labels, status = ids[:keep], labels[:keep], TRUNCATED
        if all(label == IGNORE_INDEX for label in labels):
            # a row that had labels until it was shortened is one too long, dropped (the cut left none)
            status = DROPPED_LONG if status == TRUNCATED else DROPPED_NO_LABELS
            return {"input_ids": [], "labels": [], "_status": status, "_turns": 0}
        return {"input_ids": ids, "labels": labels, "_status": status, "_turns": turns}


def _warning(stats: dict[str, int], turns: list[int], kind: str, max_seq_length: int, truncation: str) -> str:
    parts = []
    if stats["too_long"]:
        dropped_long = stats["too_long"] - stats["truncated"]
        if truncation == "turns" and kind != "text":
            if stats["truncated"]:
                low, high = min(turns), max(turns)
                span = f"{low}" if low == high else f"{low}-{high}"
                parts.append(f"{stats['truncated']} kept their first {span} whole turn{'s' * (high > 1)}")
        elif stats["truncated"]:
            parts.append(f"{stats['truncated']} cut to {max_seq_length} tokens")
        if dropped_long:
            why = f" (no label in their first {max_seq_length} tokens)" if truncation == "cut" else ""
            parts.append(f"{dropped_long} dropped{why}")
        head = f"{stats['too_long']} of {stats['rows_in']} {NOUNS[kind]} longer than {max_seq_length} tokens: "
        text = head + ", ".join(parts) + f" (--chat_truncation {truncation})"
    else:
        text = ""
    no_labels = stats["dropped"] - (stats["too_long"] - stats["truncated"])
    if no_labels:
        text += ("; " if text else "") + (
            f"{no_labels} of {stats['rows_in']} {NOUNS[kind]} dropped with no tokens to learn from"
        )
    return text


def encode_sft(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    max_seq_length: int,
    assistant_only_loss: bool,
    truncation: str,
    source: str,
) -> tuple[datasets.Dataset, dict[str, int]]:
    """Canonical SFT rows → (rows of ``input_ids`` and ``labels``, stats: rows_in, kept, dropped, truncated, too_long).

    ``template`` is the chat template text (``templates.resolve_template``); ``source`` names the data in errors and
    in the one warning line about shortened or dropped rows.
    """
    from datasets import Features, Value

    if truncation not in TRUNCATIONS:
        raise ConfigError(f"--chat_truncation {truncation!r} is not one of {', '.join(TRUNCATIONS)}")
    if max_seq_length < 1:
        raise ConfigError(f"--max_seq_length must be at least 1, not {max_seq_length}")
    kind = _row_kind(list(dataset.column_names))
    encoder = _Encoder(tokenizer, template, max_seq_length, assistant_only_loss, truncation, source, kind)
    features = Features(
        {
            "input_ids": [Value("int64")],
            "labels": [Value("int64")],
            "_status": Value("string"),
            "_turns": Value("int64"),
        }
    )
    encoded = dataset.map(
        encoder,
        with_indices=True,
        remove_columns=dataset.column_names,
        features=features,
        desc=f"Tokenizing {source}",
    )
    statuses, turn_counts = list(encoded["_status"]), list(encoded["_turns"])
    count = {s: statuses.count(s) for s in (KEPT, TRUNCATED, DROPPED_LONG, DROPPED_NO_LABELS)}
    truncated_turns = [t for s, t in zip(statuses, turn_counts, strict=True) if s == TRUNCATED]
    stats = {
        "rows_in": len(statuses),
        "kept": count[KEPT] + count[TRUNCATED],
        "dropped": count[DROPPED_LONG] + count[DROPPED_NO_LABELS],
        "truncated": count[TRUNCATED],
        "too_long": count[TRUNCATED] + count[DROPPED_LONG],
    }
    message = _warning(stats, truncated_turns, kind, max_seq_length, truncation)
    if message:
        logger.warning(f"{source!r}: {message}")
    if stats["dropped"]:
        encoded = encoded.filter(lambda status: status in (KEPT, TRUNCATED), input_columns="_status")
    return encoded.remove_columns(["_status", "_turns"]), stats
