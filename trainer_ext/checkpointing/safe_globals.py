"""The weights-only allow-list for the numpy RNG state in ``rng_state*.pth`` (as transformers reads it back)."""

from __future__ import annotations

from typing import Any


def numpy_rng_safe_globals() -> Any:
    """The weights-only allow-list transformers uses to read the numpy RNG state in ``rng_state*.pth``."""
    from transformers.trainer_pt_utils import safe_globals

    return safe_globals()
