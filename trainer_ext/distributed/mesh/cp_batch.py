"""A batch made ready to split along the sequence for context parallelism, by key name: ``shift_labels`` built from
``labels`` before the split (a slice's last label comes from the next slice), global ``position_ids``, and every
sequence tensor padded on the right to a multiple of the chunk count. Shared by the Trainer and hand-written loops.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_ext.distributed.mesh.context_parallel import SequenceSplit
from trainer_ext.errors import ConfigError

IGNORE_INDEX = -100
# the batch keys split along dimension 1, and the value each is padded with
SEQUENCE_KEYS = {
    "input_ids": 0,
    "labels": IGNORE_INDEX,
    "shift_labels": IGNORE_INDEX,
    "attention_mask": 0,
    "position_ids": 0,
    "token_type_ids": 0,
    "inputs_embeds": 0,
}


def _pad(tensor: torch.Tensor, length: int, value: int) -> torch.Tensor:
    """``tensor`` padded on the right of dimension 1 to ``length`` (always a new tensor: sharding is in place)."""
    extra = length - tensor.shape[1]
    if extra == 0:
        return tensor.clone()
    shape = list(tensor.shape)
    shape[1] = extra
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=1)


def prepare_batch(inputs: dict[str, Any], split: SequenceSplit, backend: str) -> tuple[dict[str, Any], list[Any]]:
    """A copy of ``inputs`` ready to split, and the tensors to split (their sequence dimension is 1)."""
    reference = inputs.get("input_ids", inputs.get("inputs_embeds"))
    if reference is None:
        raise ConfigError(
            "context parallelism splits input_ids (or inputs_embeds) along the sequence: the batch has neither"
        )
    batch = dict(inputs)
    size, length = reference.shape[0], reference.shape[1]
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ConfigError(
            f"context parallelism takes a 2-D attention_mask (padding), not {mask.dim()}-D: mark packed documents "
            "with position_ids that restart at 0 instead of a block mask"
        )
    if "shift_labels" not in batch and batch.get("labels") is not None:
        labels = batch["labels"]
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(length, device=reference.device).expand(size, -1)
    if backend == "torch":
        _check_causal_only(batch)
    padded = -(-length // split.multiple) * split.multiple
    buffers = []
    for key, value in SEQUENCE_KEYS.items():
        tensor = batch.get(key)
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[1] == length:
            batch[key] = _pad(
                tensor.expand(size, *tensor.shape[1:]) if key == "position_ids" else tensor, padded, value
            )
            buffers.append(batch[key])
    return batch, buffers


def is_packed(inputs: Any) -> bool:
    """True when a batch marks packed documents the way TRL's padding-free collators do: ``position_ids`` that restart
    inside a row, and no ``attention_mask``."""
    if not isinstance(inputs, dict) or inputs.get("attention_mask") is not None:
        return False
    positions = inputs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[1] < 2:
        return False
    return bool((positions[:, 1:] - positions[:, :-1] != 1).any())


def _check_causal_only(batch: dict[str, Any]) -> None:
    """torch's ring attention is causal over the whole row: refuse left padding and packed documents."""
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.bool().cummin(dim=1).values.eq(mask.bool()).all()):
        raise ConfigError(
            "cp_backend='torch' attends causally over whole rows and this batch is left-padded: pad on the right, "
            "or use cp_backend='all_gather'"
        )
    positions = batch["position_ids"]
    if bool((positions[:, 1:] - positions[:, :-1] != 1).any()):
        raise ConfigError(
            "cp_backend='torch' attends causally over whole rows and this batch packs several documents "
            "(position_ids restart): use cp_backend='all_gather', which keeps documents apart"
        )
