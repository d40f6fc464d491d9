"""The one line a migrated script changes: where its accelerate names come from.

``stock`` takes them from ``accelerate`` and its ``utils``, ``logging`` and ``local_sgd``, ``ours`` from
``trainer_ext``'s top level. A name trainer_ext lacks fails where the script uses it, with the ``AttributeError`` a
user would see after changing the import. ``set_seed`` is ``transformers.set_seed`` for both where trainer_ext has
none (the two seed the same RNGs).
"""

from __future__ import annotations

import importlib
from typing import Any

NAMES = (
    "Accelerator",
    "ProjectConfiguration",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "AutocastKwargs",
    "ProfileKwargs",
    "DistributedType",
    "find_executable_batch_size",
    "get_logger",
    "LocalSGD",
    "DeepSpeedPlugin",
    "DummyOptim",
    "DummyScheduler",
    "FullyShardedDataParallelPlugin",
)
# where accelerate keeps the names that are not in accelerate.utils
STOCK_MODULES = {
    "Accelerator": "accelerate",
    "get_logger": "accelerate.logging",
    "LocalSGD": "accelerate.local_sgd",
}  # the rest: accelerate.utils


def _trainer_ext_has_set_seed() -> bool:
    trainer_ext = importlib.import_module("trainer_ext")
    try:
        getattr(trainer_ext, "set_seed")  # noqa: B009  (a lazy attribute: hasattr would hide an import error)
    except AttributeError:
        return False
    return True


class Api:
    """The accelerate names a script uses, looked up in one implementation when the script touches them."""

    def __init__(self, impl: str) -> None:
        if impl not in ("stock", "ours"):
            raise ValueError(f"unknown implementation {impl!r}")
        self.impl = impl
        if not _trainer_ext_has_set_seed():
            self.set_seed_from = "transformers"
        else:
            self.set_seed_from = "accelerate.utils" if impl == "stock" else "trainer_ext"
        self.set_seed = getattr(importlib.import_module(self.set_seed_from), "set_seed")  # noqa: B009

    def __getattr__(self, name: str) -> Any:
        if name not in NAMES:
            raise AttributeError(f"the scripts use no accelerate name {name!r}")
        if self.impl == "ours":
            return getattr(importlib.import_module("trainer_ext"), name)
        return getattr(importlib.import_module(STOCK_MODULES.get(name, "accelerate.utils")), name)
