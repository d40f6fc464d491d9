"""What DeepSpeed's checkpoints and gathered state dicts hold: full parameter shapes (also of ZeRO-3 partitions),
the shapes a checkpoint saved, and the check that a consolidated state dict is the whole model."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainer_ext.checkpointing.deepspeed_files import load_file as load_deepspeed_file

LATEST = "latest"  # the file DeepSpeed writes next to its global_stepN folders


class ConsolidationError(RuntimeError):
    """The gathered full state dict is empty or incomplete: saving it would lose the model."""


def saved_shapes(directory: str | os.PathLike) -> tuple[dict[str, list[int]], set[str]] | None:
    """Full shapes of the parameters in a DeepSpeed checkpoint (read ``weights_only``), and the trainable names.

    None when the checkpoint has no model-states file to read them from.
    """
    root = Path(directory)
    tag = (root / LATEST).read_text(encoding="utf-8").strip()
    files = sorted((root / tag).glob("*model_states.pt"))
    if not files:
        return None
    saved = load_deepspeed_file(files[0])
    groups = saved.get("param_shapes") or []
    trainable = {name: list(shape) for group in groups for name, shape in group.items()}
    frozen = {name: list(shape) for name, shape in (saved.get("frozen_param_shapes") or {}).items()}
    return {**frozen, **trainable}, set(trainable)


def full_shape(param: torch.nn.Parameter) -> torch.Size:
    """A parameter's full shape, also when ZeRO-3 has partitioned it (``ds_shape``)."""
    return getattr(param, "ds_shape", param.shape)


def check_complete(module: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Raise :class:`ConsolidationError` unless every parameter of ``module`` is in ``state_dict`` in full."""
    expected = {name: full_shape(p) for name, p in module.named_parameters(remove_duplicate=False)}
    if not state_dict or not expected:
        raise ConsolidationError(
            f"the consolidated state dict has {len(state_dict)} tensors for a model with {len(expected)} parameters; "
            "refusing to save an empty model"
        )
    missing = sorted(set(expected) - set(state_dict))
    wrong = sorted(
        f"{name} {tuple(state_dict[name].shape)} (expected {tuple(shape)})"
        for name, shape in expected.items()
        if name in state_dict and tuple(state_dict[name].shape) != tuple(shape)
    )
    if missing or wrong:
        details = []
        if missing:
            details.append(f"missing {len(missing)}: {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
        if wrong:
            details.append(f"wrong size {len(wrong)}: {', '.join(wrong[:5])}{' …' if len(wrong) > 5 else ''}")
        raise ConsolidationError(
            "the consolidated state dict is incomplete (a ZeRO-3 gather that did not happen?): " + "; ".join(details)
        )
    unique = {id(p): p for p in module.parameters()}
    want = sum(int(torch.Size(full_shape(p)).numel()) for p in unique.values())
    seen: dict[int, int] = {}
    for name in expected:
        tensor = state_dict[name]
        seen[tensor.data_ptr() if tensor.numel() else id(tensor)] = tensor.numel()
    have = sum(seen.values())
    if have != want:
        raise ConsolidationError(f"the consolidated state dict holds {have} parameter values; the model has {want}")
