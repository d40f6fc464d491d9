"""The Trainer under pipeline parallelism (ours): the training step runs the schedule over the batch's microbatches
(forward and backward of every stage, the loss from the last stage, reduced to every rank), evaluation runs the
batch forward through the stages, and transformers' counts of batches and label tokens leave out the pipeline ranks that read the
same batch, as they leave out tensor-parallel ones.

Gradient accumulation: each accumulation step is one schedule run of ``pp_microbatches`` microbatches, its loss over
the token count of the whole accumulation window (transformers' ``num_items_in_batch``), so accumulation is exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainer_ext.distributed.pipeline.split import split_of
from trainer_ext.errors import ConfigError


class PipelineMixin:
    """Mix in before ``transformers.Trainer``; inert unless the prepared model carries a pipeline runtime."""

    def _pipeline_size(self) -> int:
        config = getattr(self.accelerator, "parallelism_config", None)
        return 1 if config is None else config.pp_size

    def _pipeline_of(self, model: Any) -> Any:
        return split_of(self.accelerator.unwrap_model(model)) if model is not None else None

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        runtime = self._pipeline_of(model)
        if runtime is None:
            return super().training_step(model, inputs, num_items_in_batch, **kwargs)
        if type(self).compute_loss is not PipelineMixin.compute_loss or self.compute_loss_func is not None:
            raise ConfigError(
                f"pipeline parallelism computes the causal-LM loss on the last stage; {type(self).__name__} "
                "computes its own (compute_loss or compute_loss_func): set pp_size=1"
            )
        model.train()
        inputs = self._prepare_inputs(inputs)
        counted = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        if counted:
            # the sum over this rank's tokens / the window's tokens; FSDP averages over the data-parallel ranks
            scale = (
                float(self.accelerator.num_data_parallel_processes) if self.args.average_tokens_across_devices else 1.0
            )
        else:
            num_items_in_batch, scale = None, 1.0 / self.current_gradient_accumulation_steps
        return runtime.train_step(inputs, num_items_in_batch, scale=scale)

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """Outside the training step (the exact eval loss's forward on a last batch's real rows): the loss of the
        batch forward through the stages, its token mean, and its logits."""
        runtime = self._pipeline_of(model)
        if runtime is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss, logits = runtime.eval_step(inputs)
        return (loss, {"logits": logits}) if return_outputs else loss

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: Any = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        runtime = self._pipeline_of(model)
        if runtime is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        model.eval()
        inputs = self._prepare_inputs(inputs)
        loss, logits = runtime.eval_step(inputs)
        if prediction_loss_only:
            return loss, None, None
        return loss, logits, inputs.get("labels")

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """transformers' count over every process, less the pipeline ranks that counted the same batch."""
        items = super()._get_num_items_in_batch(batch_samples, device)
        pp = self._pipeline_size()
        if items is not None and pp > 1 and self.args.average_tokens_across_devices and self.args.world_size > 1:
            items = items / pp
        return items

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """transformers' estimate (6 × tokens × non-embedding parameters) with the whole model's parameters: each
        pipeline rank holds a part, and the Trainer divides the ranks' sum by the ranks that shared the batch."""
        model = self.accelerator.unwrap_model(self.model) if self.model is not None else None
        shapes = getattr(model, "_trainer_ext_full_shapes", None)
        if shapes is None or "input_ids" not in inputs:
            return super().floating_point_ops(inputs)
        count = sum(math.prod(shape) for name, shape in shapes.items() if "embed_tokens" not in name)
        return 6 * inputs["input_ids"].numel() * count

    def get_total_train_batch_size(self, args: Any) -> int:
        """transformers' total batch, less the pipeline ranks that read the same batch."""
        return super().get_total_train_batch_size(args) // self._pipeline_size()
