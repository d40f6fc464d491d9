"""What the Trainer needs of transformers' private internals (tested: transformers >=5.17,<5.25; newer ones warn).

transformers' ``trainer.py`` and ``training_args.py`` bind a few accelerate names at module level only
when accelerate is installed, yet reach them on every run (``DistributedType`` in ``_run_epoch``,
``skip_first_batches`` on mid-epoch resume …). :func:`install` provides ours under those names, only
where they are missing. While one of our trainers trains (:func:`training_loop_names`), the loop's
``find_executable_batch_size`` and an accelerate ``skip_first_batches`` are routed to ours for our trainers and
dataloaders, and put back afterwards. docs/runtime-patches.md lists every runtime patch. Nothing here imports
accelerate.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

# the RNG allow-list lives below, in checkpointing/, which verifies RNG files without importing this module
from trainer_ext.checkpointing.safe_globals import numpy_rng_safe_globals as numpy_rng_safe_globals
from trainer_ext.distributed.data.loader import skip_first_batches as _our_skip_first_batches
from trainer_ext.distributed.data.prepared import TrackedIteration
from trainer_ext.distributed.memory import clear_device_cache, release_memory, should_reduce_batch_size
from trainer_ext.distributed.state import DistributedType

TESTED_TRANSFORMERS = (Version("5.17.0"), Version("5.25.0"))  # [oldest, first untested): CI's compat subset
# Versions known to break, refused at import: before 5.17 the internals we override are missing. Add a release here
# (e.g. "==5.30.0") when one is found broken, until a fix ships.
BROKEN_TRANSFORMERS = SpecifierSet("<5.17")
_warned_newer = False


def check_transformers_version(version: str | None = None) -> None:
    """Refuse a transformers version known to break; warn once per process on one newer than tested."""
    global _warned_newer
    found = Version(version or transformers.__version__)
    low, high = TESTED_TRANSFORMERS
    tested = f">={low},<{high}"
    base = Version(found.base_version)  # 5.25.0.dev0 counts as 5.25.0
    if BROKEN_TRANSFORMERS.contains(base, prereleases=True):
        raise ImportError(
            f"trainer_ext does not work with transformers {found} (known broken: {BROKEN_TRANSFORMERS}; tested: "
            f"{tested}). Install a tested version: pip install 'transformers{tested}'"
        )
    if base >= high and not _warned_newer:
        _warned_newer = True
        warnings.warn(
            f"trainer_ext is tested with transformers {tested}; {found} is newer: the Trainer integration relies on "
            f"transformers internals that may have changed. If something breaks, please report it "
            f"(with `trainer-ext env`) and install a tested version: pip install 'transformers{tested}'",
            UserWarning,
            stacklevel=2,
        )


def _routing_skip_first_batches(original: Any) -> Any:
    """``skip_first_batches`` that skips our loaders with ours and any other one with ``original`` (accelerate's)."""

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        if isinstance(dataloader, TrackedIteration):  # every loader of ours
            return _our_skip_first_batches(dataloader, num_batches)
        return original(dataloader, num_batches)

    return skip_first_batches


def _routing_find_executable_batch_size(original: Any) -> Any:
    """``find_executable_batch_size`` that runs our trainers' loop once (they shrink the micro-batch themselves).

    transformers' own one needs accelerate as soon as ``auto_find_batch_size`` is set."""

    def find_executable_batch_size(
        function: Any = None, starting_batch_size: int = 128, auto_find_batch_size: bool = False
    ) -> Any:
        from trainer_ext.trainer.auto_batch import AutoBatchMixin

        if function is None:
            return functools.partial(
                find_executable_batch_size,
                starting_batch_size=starting_batch_size,
                auto_find_batch_size=auto_find_batch_size,
            )
        if isinstance(getattr(function, "__self__", None), AutoBatchMixin):
            # our trainers shrink the micro-batch inside the step: no restart of the loop, no accelerate
            return functools.partial(function, batch_size=starting_batch_size)
        return original(function, starting_batch_size, auto_find_batch_size)

    return find_executable_batch_size


_installed = False


def install() -> None:
    """Provide the accelerate names transformers' Trainer and arguments reach; idempotent, sets only missing names."""
    global _installed
    if _installed:
        return
    check_transformers_version()
    import transformers.trainer as hf_trainer
    import transformers.training_args as hf_args

    fallbacks = {
        "DistributedType": DistributedType,
        "clear_device_cache": clear_device_cache,
        "release_memory": release_memory,
        "should_reduce_batch_size": should_reduce_batch_size,
        "skip_first_batches": _our_skip_first_batches,  # any loader: a stock Trainer would fail on the name
    }
    for name, value in fallbacks.items():
        if not hasattr(hf_trainer, name):
            setattr(hf_trainer, name, value)
    if not hasattr(hf_args, "DistributedType"):
        hf_args.DistributedType = DistributedType
    _installed = True


_loop_lock = threading.Lock()
_loop_depth = 0  # our trainers training now (nested or in threads): the names go back when the last one ends
_loop_saved: dict[str, tuple[Any, Any]] = {}  # name -> (transformers' binding, ours in its place)


@contextlib.contextmanager
def training_loop_names() -> Iterator[None]:
    """While it is open, transformers' loop reaches our ``find_executable_batch_size`` and, where accelerate bound
    its own, a ``skip_first_batches`` routed to ours for our loaders; both are put back when the last one closes."""
    global _loop_depth
    install()
    import transformers.trainer as hf_trainer

    with _loop_lock:
        if _loop_depth == 0:
            routes = {"find_executable_batch_size": _routing_find_executable_batch_size}
            if hf_trainer.skip_first_batches is not _our_skip_first_batches:  # accelerate's: our loaders need ours
                routes["skip_first_batches"] = _routing_skip_first_batches
            for name, route in routes.items():
                original = getattr(hf_trainer, name)
                _loop_saved[name] = (original, route(original))
                setattr(hf_trainer, name, _loop_saved[name][1])
        _loop_depth += 1
    try:
        yield
    finally:
        with _loop_lock:
            _loop_depth -= 1
            if _loop_depth == 0:
                for name, (original, ours) in _loop_saved.items():
                    if getattr(hf_trainer, name) is ours:  # left alone if someone rebound it meanwhile
                        setattr(hf_trainer, name, original)
                _loop_saved.clear()


def accelerator_config(raw: Any) -> Any:
    """``args.accelerator_config`` as transformers' AcceleratorConfig (it stays raw without accelerate)."""
    from transformers.trainer_pt_utils import AcceleratorConfig

    if isinstance(raw, AcceleratorConfig):
        return raw
    if raw is None:
        return AcceleratorConfig()
    if isinstance(raw, dict):
        return AcceleratorConfig(**raw)
    if isinstance(raw, type):  # the class itself, not an instance: transformers' error
        raise NotImplementedError(
            "Tried passing in a callable to `accelerator_config`, but this is not supported. "
            "Please pass in a fully constructed `AcceleratorConfig` object instead."
        )
    if hasattr(raw, "to_dict"):  # accelerate's or another copy of the same dataclass
        return AcceleratorConfig(**raw.to_dict())
    return AcceleratorConfig.from_json_file(raw)


def uses_activation_checkpointing(model: Any, args: Any) -> bool:
    """Activation checkpointing on the model or in the args (renamed from gradient_checkpointing in 5.23)."""
    on_model = getattr(model, "is_activation_checkpointing", None)
    if on_model is None:
        on_model = getattr(model, "is_gradient_checkpointing", False)
    on_args = getattr(args, "activation_checkpointing", None)
    if on_args is None:
        on_args = getattr(args, "gradient_checkpointing", False)
    return bool(on_model or on_args)


def _unwrapped(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _loss_function_calls(model: Any) -> tuple[list[Any], Any] | None:
    """The ``loss_function(...)`` calls in ``model.forward`` and its parsed source; None when that is unreadable."""
    import ast
    import textwrap

    forward = getattr(type(model), "forward", None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "loss_function"
    ]
    return calls, tree


def loss_uses_num_items(model: Any) -> bool | None:
    """Does ``model.forward`` pass ``num_items_in_batch`` on to its loss? None when its source is unreadable.

    transformers assumes so for any forward taking ``**kwargs``; many heads (BERT classifiers, the generic
    sequence-classification head) compute a plain mean instead, and the Trainer then scales their loss by
    the world size and skips the division by the accumulation steps.
    """
    import ast

    base = _unwrapped(model)
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    found = _loss_function_calls(base)
    if found is None:
        return None
    calls, tree = found
    if not calls:
        return any(isinstance(n, ast.Name) and n.id == "num_items_in_batch" for n in ast.walk(tree))
    return any(kw.arg is None or kw.arg == "num_items_in_batch" for call in calls for kw in call.keywords)


def loss_shifts_labels(model: Any) -> bool:
    """Does the model's loss predict label i+1 at position i (transformers' causal-LM loss on a decoder)?

    transformers asks the model's ``loss_type`` alone, which heads named without one (``GPT2LMHeadModel``,
    ``OpenAIGPTLMHeadModel`` …) leave unset, although their ``self.loss_function`` then falls back to the
    causal-LM loss: those count here as shifting when their forward calls it.
    """
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    base = _unwrapped(model)
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        return False
    function = getattr(base, "_loss_function", None)  # set through the loss_function setter
    if function is None:
        loss_type = getattr(base, "loss_type", None)
        if loss_type in LOSS_MAPPING:
            function = LOSS_MAPPING[loss_type]
        elif isinstance(base, transformers.PreTrainedModel):
            found = _loss_function_calls(base)
            if found is not None and found[0]:
                function = ForCausalLMLoss  # the loss_function property's fallback for a missing or unknown type
    return function is ForCausalLMLoss
