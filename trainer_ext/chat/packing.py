"""Packing tokenised SFT examples into blocks, and the SFT collator.

How packing keeps documents apart: ``pack_examples`` places whole examples ("documents") into blocks of at most
``max_seq_length`` tokens by best-fit-decreasing, exactly as TRL's ``pack_dataset(strategy="bfd")`` does (the same
bins, in the same order, filled within the same chunks of rows). Each packed row carries ``position_ids`` that
restart at 0 at every document, and the collator sends them with NO ``attention_mask``: transformers then finds the
documents from the position jumps (``masking_utils.find_packed_sequence_indices``) and builds a block-causal mask,
so a token attends only to the earlier tokens of its own document, and rotary/learned positions are those of the
document alone. The first label of every document is -100, so the last token of one document never learns to
predict the first token of the next. The forward must run without a key/value cache (``use_cache=False``, which
trainer_ext's Trainer passes for packed batches): with one, transformers skips the packed-document mask. A packed
forward then equals the unpacked forwards token for token (tests/chat/test_packing.py); ``packing_supported`` says
whether a model builds its mask from position_ids (most decoder-only models in transformers do; OPT, Bloom, MPT,
gpt-oss and state-space models such as Mamba do not).
"""

from __future__ import annotations

import ast
import bisect
import inspect
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from trainer_ext.chat.names import IGNORE_INDEX as IGNORE_INDEX
from trainer_ext.errors import ConfigError

TRL_CHUNK_ROWS = 1000
"""Rows packed together: TRL packs inside ``Dataset.map(batched=True)``, whose batches hold 1000 rows."""

_MASK_BUILDERS = {"create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"}
_PACKED_ATTENTION = {"sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"}


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices into ``lengths`` (each sum at most ``capacity``), best-fit-decreasing as TRL's ``_pack_bfd``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: equal lengths keep their row order
    spaces: list[int] = []  # sorted distinct free spaces (< capacity) that some open bin has
    by_space: dict[int, deque[list[int]]] = {}
    bins: list[list[int]] = []
    for index in order:
        length = lengths[index]
        at = bisect.bisect_left(spaces, length)
        if at < len(spaces):  # the open bin with the least free space that still fits (the oldest of those)
            space = spaces[at]
            members = by_space[space].popleft()
            if not by_space[space]:
                del by_space[space]
                spaces.pop(at)
        else:
            space, members = capacity, []
            bins.append(members)
        members.append(index)
        space -= length
        if space > 0:
            if space not in by_space:
                by_space[space] = deque()
                bisect.insort(spaces, space)
            by_space[space].append(members)
    return bins


def _pack_chunk(rows: dict[str, list], max_seq_length: int) -> dict[str, list]:
    input_ids = rows["input_ids"]
    labels = rows["labels"] if "labels" in rows else input_ids
    kept = [i for i, ids in enumerate(input_ids) if len(ids) > 0]  # TRL drops empty examples too
    bins = best_fit_decreasing([len(input_ids[i]) for i in kept], max_seq_length)
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "seq_lengths": []}
    for members in bins:
        block_ids, block_labels, positions, lengths = [], [], [], []
        for member in members:
            ids, doc_labels = list(input_ids[kept[member]]), list(labels[kept[member]])
            block_ids += ids
            block_labels += [IGNORE_INDEX] + doc_labels[1:]
            positions += range(len(ids))
            lengths.append(len(ids))
        out["input_ids"].append(block_ids)
        out["labels"].append(block_labels)
        out["position_ids"].append(positions)
        out["seq_lengths"].append(lengths)
    return out


def pack_examples(dataset: Any, max_seq_length: int, seed: int | None = None, chunk_rows: int = TRL_CHUNK_ROWS) -> Any:
    """Pack tokenised examples into rows of input_ids, labels, position_ids, seq_lengths (best-fit-decreasing)."""
    if max_seq_length < 1:
        raise ConfigError(f"max_seq_length is {max_seq_length}; packing needs a positive --max_seq_length")
    if "input_ids" not in dataset.column_names:
        raise ConfigError(f"packing needs tokenised rows with input_ids (columns: {', '.join(dataset.column_names)})")
    for index, ids in enumerate(dataset["input_ids"]):
        if len(ids) > max_seq_length:
            raise ConfigError(
                f"row {index} has {len(ids)} tokens, more than max_seq_length {max_seq_length}; truncate the rows "
                "before packing (--chat_truncation) or raise --max_seq_length"
            )
    if "labels" in dataset.column_names:
        for index, (ids, labels) in enumerate(zip(dataset["input_ids"], dataset["labels"], strict=True)):
            if len(ids) != len(labels):
                raise ConfigError(f"row {index} has {len(ids)} input_ids but {len(labels)} labels; they must match")
    if seed is not None:  # TRL's shuffle_dataset shuffles right before packing with the same call
        dataset = dataset.shuffle(seed=seed)
    return dataset.map(
        _pack_chunk,
        batched=True,
        batch_size=chunk_rows,
        fn_kwargs={"max_seq_length": max_seq_length},
        remove_columns=dataset.column_names,
        desc="Packing",
    )


def positions_from_seq_lengths(seq_lengths: list[int]) -> list[int]:
    """position_ids restarting at 0 for each document of a packed row, from its document lengths."""
    return [position for length in seq_lengths for position in range(length)]


def _pad(rows: list[torch.Tensor], length: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


@dataclass
class SFTCollator:
    """Batches SFT rows, right-padded: packed rows get position_ids and no attention_mask, others an attention_mask.

    Packed rows (with ``position_ids`` or ``seq_lengths``) come out as ``input_ids``, ``labels`` (each document's
    first label -100) and ``position_ids``; the padding after a shorter row is one more document of pad tokens at
    positions 0, 1, ... with labels -100, so real tokens never see it. ``padding_free`` concatenates the batch into
    one row instead, as TRL's padding-free collator does (unpacked rows then become documents too).
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    padding_free: bool = False

    def _length(self, longest: int) -> int:
        multiple = self.pad_to_multiple_of
        return longest if not multiple else -(-longest // multiple) * multiple

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Collate a list of rows into a batch of tensors."""
        packed = ["position_ids" in row or "seq_lengths" in row for row in examples]
        if any(packed) and not all(packed):
            raise ConfigError("a batch mixes packed rows (position_ids) with unpacked ones; pack all rows or none")
        input_ids = [torch.as_tensor(row["input_ids"], dtype=torch.long) for row in examples]
        labels = [torch.as_tensor(row.get("labels", row["input_ids"]), dtype=torch.long).clone() for row in examples]
        if any(packed) or self.padding_free:
            positions = [self._positions(row, len(ids)) for row, ids in zip(examples, input_ids, strict=True)]
            if self.padding_free:
                input_ids, labels, positions = [torch.cat(input_ids)], [torch.cat(labels)], [torch.cat(positions)]
            length = self._length(max(ids.numel() for ids in input_ids))
            batch_positions = torch.stack(
                [torch.cat([p, torch.arange(length - p.numel(), dtype=torch.long)]) for p in positions]
            )
            batch_labels = _pad(labels, length, IGNORE_INDEX)
            batch_labels[batch_positions == 0] = IGNORE_INDEX  # no prediction across a document boundary
            return {
                "input_ids": _pad(input_ids, length, self.pad_token_id),
                "labels": batch_labels,
                "position_ids": batch_positions,
            }
        length = self._length(max(ids.numel() for ids in input_ids))
        mask = [torch.ones_like(ids) for ids in input_ids]
        return {
            "input_ids": _pad(input_ids, length, self.pad_token_id),
            "labels": _pad(labels, length, IGNORE_INDEX),
            "attention_mask": _pad(mask, length, 0),
        }

    @staticmethod
    def _positions(row: dict[str, Any], length: int) -> torch.Tensor:
        if "position_ids" in row:
            return torch.as_tensor(row["position_ids"], dtype=torch.long)
        if "seq_lengths" in row:
            return torch.as_tensor(positions_from_seq_lengths(list(row["seq_lengths"])), dtype=torch.long)
        return torch.arange(length, dtype=torch.long)


def _passes_positions_to_mask(module_name: str) -> bool:
    """True when the modeling module builds its causal mask with ``position_ids`` (so packed rows get block masks)."""
    module = sys.modules.get(module_name)
    try:
        tree = ast.parse(inspect.getsource(module)) if module is not None else None
    except (OSError, TypeError):
        return False
    if tree is None:
        return False
    builders = set(_MASK_BUILDERS)
    for node in ast.walk(tree):  # mask_function = create_causal_mask if ... else create_sliding_window_causal_mask
        if isinstance(node, ast.Assign) and any(
            isinstance(n, ast.Name) and n.id in _MASK_BUILDERS for n in ast.walk(node.value)
        ):
            builders |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in builders
    ]
    dict_keys = {
        key.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Dict)
        for key in node.keys
        if isinstance(key, ast.Constant)
    }

    def passes(call: ast.Call) -> bool:  # position_ids=..., or **mask_kwargs from a dict literal naming it
        return any(k.arg == "position_ids" or (k.arg is None and "position_ids" in dict_keys) for k in call.keywords)

    return bool(calls) and all(passes(call) for call in calls)


def _unwrap(model: Any) -> Any:
    while True:
        if hasattr(model, "get_base_model"):  # peft
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP and friends
            model = model.module
        else:
            return model


def packing_supported(model: Any) -> bool:
    """True when the model builds a block-causal mask from position_ids (packed documents stay apart exactly)."""
    model = _unwrap(model)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in _PACKED_ATTENTION:
        return False
    base = getattr(model, "base_model", model)
    # the module whose forward runs (an FSDP2-wrapped model is a subclass of the model's class, same forward)
    modules = {getattr(type(m).forward, "__module__", "") for m in (model, base)}
    return any(_passes_positions_to_mask(name) for name in modules)


def check_packing_supported(model: Any) -> None:
    """Raise a one-line ConfigError when packing would let documents see each other in this model."""
    if packing_supported(model):
        return
    inner = _unwrap(model)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", type(inner).__name__)
    attention = getattr(config, "_attn_implementation", None)
    raise ConfigError(
        f"--packing needs a model that builds its attention mask from position_ids; {model_type} (attention "
        f"{attention}) does not, so packed documents would attend to each other; drop --packing"
        + ("" if attention in _PACKED_ATTENTION else " or load the model with sdpa attention")
    )
