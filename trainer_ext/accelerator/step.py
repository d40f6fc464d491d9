"""What the ``Accelerator``'s step adds to the engine's, with accelerate's meaning: the accumulation count behind
``accumulate``, LOMO's fused backward, a DDP backward that syncs after ``no_sync`` forwards, and the profiler."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer_ext.accelerator.options import ProfileKwargs
from trainer_ext.errors import ConfigError


def count_micro_batch(gradient_state: Any, step: int, accumulation_steps: int) -> int:
    """accelerate's rule: the last batch of a loader syncs and restarts the count; otherwise every N-th does.
    Sets the gradient state's ``sync_gradients`` and returns the new count."""
    if gradient_state.plugin_kwargs.get("sync_with_dataloader", True) and gradient_state.end_of_dataloader:
        gradient_state._set_sync_gradients(True)
        return 0
    step += 1
    gradient_state._set_sync_gradients(step % accumulation_steps == 0)
    return step


def check_lomo(engine: Any, learning_rate: float | None) -> None:
    """``lomo_backward`` needs a learning rate and a prepared LOMO/AdaLomo optimizer (``lomo-optim``)."""
    if learning_rate is None:
        raise ConfigError("A learning rate must be passed in order to call backward pass with LOMO optimizers.")
    if not any(hasattr(o.optimizer, "fused_backward") for o in engine.prepared_optimizers):
        raise ConfigError(
            "Backward pass not properly called on LOMO optimizers. Are you sure you passed a LOMO optimizer in "
            "accelerator.prepare()?"
        )


@contextlib.contextmanager
def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
    """Make the next backward of a DDP model all-reduce its gradients after forwards run under ``no_sync``."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        yield
        return
    saved = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = saved


@contextlib.contextmanager
def profiled(handler: ProfileKwargs, process_index: int, barrier: Callable[[], None]) -> Iterator[Any]:
    """``torch.profiler`` around the block; with ``output_trace_dir`` each process writes its Chrome trace, then
    waits for the others."""
    with handler.build() as profiler:
        yield profiler
    if handler.output_trace_dir is not None:
        handler.export_trace(profiler, process_index)
        barrier()


def unscale(engine: Any, optimizer: Any) -> None:
    """Unscale the fp16 gradients of ``optimizer`` (one, a list, or every prepared one with None)."""
    if optimizer is None:
        engine.unscale_gradients()
        return
    for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        engine.precision.unscale_(getattr(opt, "optimizer", opt))
