"""A DeepSpeed checkpoint's files as checkpoint I/O reads them, without importing DeepSpeed.

The one place below the engine that knows DeepSpeed's on-disk layout: its ``latest`` file naming a tag folder, the
classes it pickles, its per-rank partition files. Checkpoint I/O verifies, fsyncs and audits such folders with no
backend loaded (``trainer-ext checkpoint`` on any machine); the DeepSpeed strategy writes them and reads them back
through these names.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer_ext.checkpointing.errors import CheckpointError

LATEST = "latest"  # names the tag folder (``global_stepN``) beside it
_LATEST_MAX = 256  # bytes: a tag name such as ``global_step1200``
# its per-rank partition files (fsynced by the rank that wrote them): ``[bf16_]zero_pp_rank_N_...``
RANK_FILE = r"(?:bf16_)?zero_pp_rank_(\d+)_[^/]*"


def owns(root: Path, path: Path) -> bool:
    """True when ``path`` under checkpoint ``root`` is a DeepSpeed file: ``latest``, or a torch file of a tag folder."""
    return path.name == LATEST or (path.suffix in (".pt", ".pth", ".bin") and in_tag_folder(path, root))


def check(path: Path, check_zip: Callable[[Path], None]) -> None:
    """CheckpointError unless ``path`` (one :func:`owns`) is safe for DeepSpeed to load: DeepSpeed unpickles its
    files in full, so each must be whole (``check_zip``) and hold nothing but tensors, containers and its classes."""
    if path.name == LATEST:
        check_latest(path)
        return
    check_zip(path)
    check_file(path)


def in_tag_folder(path: Path, root: Path) -> bool:
    """A file of a DeepSpeed checkpoint's tag folder (``global_stepN/`` next to its ``latest`` file)."""
    return path.parent != root and (path.parent.parent / LATEST).is_file()


class _Stand:
    """Stands in for a DeepSpeed class while checking a file: built from its pickled state, never run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


# the classes DeepSpeed pickles into its checkpoints besides tensors and containers (loss scaler, ZeRO stage,
# parameter fragment addresses); DeepSpeed unpickles them in full, so nothing else may be in its files
CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def load_file(path: Path) -> Any:
    """A DeepSpeed file loaded ``weights_only``, its own classes stood in for (no DeepSpeed import, no code run)."""
    with torch.serialization.safe_globals([(_Stand, name) for name in CLASSES]):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def check_file(path: Path) -> None:
    """CheckpointError when a DeepSpeed file holds anything but tensors, containers and DeepSpeed's own classes."""
    try:
        load_file(path)
    except Exception as error:  # a global outside torch's allow-list and DeepSpeed's classes, or a damaged file
        reason = " ".join(str(error).split())[:300]
        raise CheckpointError(
            f"{path.parent.name}/{path.name} holds more than DeepSpeed saves (it could run code when DeepSpeed "
            f"loads it): {reason}"
        ) from error


def check_latest(path: Path) -> None:
    """``latest`` must name a real tag folder directly beside it: DeepSpeed loads whatever folder it names."""
    size = path.stat().st_size
    if size > _LATEST_MAX:
        raise CheckpointError(
            f"{path.name} has {size} bytes, more than a DeepSpeed tag name ({_LATEST_MAX} at most): it is corrupted "
            "or crafted; pick another checkpoint"
        )
    try:
        tag = path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path.name} is corrupted (not a tag name: {error})") from error
    target = path.parent / tag
    if (
        not tag
        or "/" in tag
        or "\\" in tag
        or tag in (".", "..")
        or target.is_symlink()
        or not target.is_dir()
        or target.resolve().parent != path.parent.resolve()
    ):
        raise CheckpointError(
            f"{path.name} names {tag!r}, which is not a checkpoint folder beside it (a plain folder, not a link)"
        )
