"""A hand-written loop's step under pipeline parallelism (``ParallelismConfig(pp_size=...)``): ``prepare`` splits the
model into this rank's stages, and these functions run a batch through the schedule, as the Trainer does.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = pipeline_step(model, batch, accelerator)  # forward and backward: no accelerator.backward
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()

``pipeline_step`` splits the batch into the schedule's microbatches, runs every stage's forward and backward, and
returns the loss on every rank of the pipeline. Without ``num_items_in_batch`` backward takes the batch's token mean
over ``gradient_accumulation_steps`` (what ``accelerator.backward(outputs.loss)`` takes); with the label-token count
of the whole accumulation window over the data-parallel ranks it takes the token sum over that count, so the loop
trains what one process trains on the concatenated batch. ``pipeline_eval_step`` runs the batch forward through the
stages and returns the loss and the logits on every rank (gather them over the data-parallel ranks with ``gather_for_metrics``).
The model computes its causal-LM loss from ``labels`` on the last stage: the batch holds ``input_ids``, ``labels``
and optionally ``attention_mask`` and ``position_ids``.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_ext.distributed.pipeline.split import split_of
from trainer_ext.errors import ConfigError


def _runtime(model: Any, caller: str) -> Any:
    inner = getattr(model, "module", model)  # a DDP/compile wrapper would hide the attribute
    runtime = split_of(getattr(inner, "_orig_mod", inner))
    if runtime is None:
        raise ConfigError(
            f"{caller} runs a model split into pipeline stages, and {type(model).__name__} is not one: build the "
            "Accelerator with ParallelismConfig(pp_size=...) and pass the model through accelerator.prepare"
        )
    return runtime


def pipeline_step(
    model: Any, batch: dict[str, Any], accelerator: Any, num_items_in_batch: int | torch.Tensor | None = None
) -> torch.Tensor:
    """Forward and backward of ``batch`` through the pipeline schedule; gradients accumulate in this rank's stages.

    ``num_items_in_batch``: the labelled tokens (after the shift) of the accumulation window on every data-parallel
    rank together; backward then takes this rank's token sum over it, times the data-parallel ranks FSDP averages
    over. Without it backward takes the batch's token mean over ``gradient_accumulation_steps``. Returns the loss
    before that scaling (this rank's share of the window's loss, or the batch mean), the same on every pp rank."""
    runtime = _runtime(model, "pipeline_step")
    model.train()
    engine = getattr(accelerator, "engine", accelerator)
    if num_items_in_batch is not None:
        scale = float(engine.num_data_parallel_processes)
    else:
        scale = 1.0 / accelerator.gradient_accumulation_steps
    loss = runtime.train_step(_on(batch, engine.device), num_items_in_batch, scale=scale)
    return loss / scale


@torch.no_grad()
def pipeline_eval_step(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``batch`` forward through the stages: the loss (the batch's token mean; None without ``labels``) and the
    logits, on every rank of the pipeline."""
    runtime = _runtime(model, "pipeline_eval_step")
    model.eval()
    return runtime.eval_step(_on(batch, runtime.device))


def _on(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
