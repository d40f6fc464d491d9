"""Pipeline parallelism (ours): the model split into stages over the mesh's ``pp`` dimension, each stage's layers
tensor-parallel over ``tp`` when it is enabled and FSDP2-sharded over the data-parallel dimensions when there are any, run by a ``torch.distributed.pipelining`` schedule
(:class:`~trainer_ext.distributed.pipeline.runtime.PipelineRuntime`, carried by the prepared model).

Checkpoints are FSDP's sharded ones (each stage writes its tensors under the full model's names, so they load on any
other layout); the export and the gradient norm span the stages.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from trainer_ext.distributed.mesh.config import ParallelismConfig
from trainer_ext.distributed.mesh.grad_norm import total_grad_norm
from trainer_ext.distributed.mesh.tensor_parallel import apply_tensor_parallel
from trainer_ext.distributed.pipeline import checkpoint as pipeline_checkpoint
from trainer_ext.distributed.pipeline import schedules, split
from trainer_ext.distributed.pipeline.runtime import PipelineRuntime
from trainer_ext.distributed.strategies.fsdp.strategy import FSDPStrategy, checkpoint_forward
from trainer_ext.errors import ConfigError

logger = logging.getLogger(__name__)


class PipelineStrategy(FSDPStrategy):
    """Stages over ``pp``, each sharded by FSDP2 over the data-parallel dimensions (none: plain stages)."""

    name = "pipeline"
    title = "pipeline parallelism"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._full_names: dict[int, str] = {}  # parameter id before the split -> its name in the whole model

    @classmethod
    def check_parallelism(cls, config: ParallelismConfig) -> None:
        if not config.pp_enabled:
            raise ConfigError("the pipeline strategy needs parallelism_config pp_size > 1")

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Split ``model`` in place into this rank's stages, shard each over the data-parallel mesh, and attach the
        runtime that runs the schedule; the returned model is the same object, holding only this rank's part."""
        if split.split_of(model) is not None:
            return model
        config, built = self.parallelism, self.parallel
        per_rank = schedules.stages_per_rank(config.pp_schedule)
        num_stages = config.pp_size * per_rank
        split.check_model(model, num_stages)
        if self.mixed_precision == "fp16":
            raise ConfigError(
                "pipeline parallelism does not apply fp16's loss scaling inside its schedule: train with bf16 (or "
                "float32), or set pp_size=1"
            )
        pp_mesh = built["pp"]
        ids = schedules.stage_ids(config.pp_schedule, pp_mesh.get_local_rank(), config.pp_size)
        shapes = split.full_shapes(model)
        ranges = split.layer_ranges(model, num_stages, config.pp_split)
        before = dict(model.named_parameters())
        self._full_names.update({id(p): name for name, p in before.items()})
        split.prune(model, ranges, ids)
        if config.tp_enabled:  # the model's own plan over this rank's modules (what the split removed is skipped)
            apply_tensor_parallel(model, built["tp"], getattr(config.tp_handler, "tp_plan", None))
        stages = split.stage_modules(model, ranges, ids)
        mesh = self.mesh()
        for stage in stages:  # under --bf16/--fp16 each stage runs under autocast and sends float32, as the model
            self.precision.patch_forward(stage)
        dtype = torch.float32 if self.precision.dtype is not None else next(model.parameters()).dtype
        if self.settings.activation_checkpointing:  # --fsdp_config's: each decoder layer recomputed in backward
            for stage in stages:
                for layer in stage.layers:
                    checkpoint_forward(layer)
        if mesh is not None:
            kwargs = {"mesh": mesh, "reshard_after_forward": False, "mp_policy": self.mp_policy()}
            if self.settings.cpu_offload:
                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            for stage in stages:
                for layer in stage.layers:
                    fully_shard(layer, **kwargs)
                fully_shard(stage, **kwargs)
        microbatches = config.pp_microbatches or schedules.default_microbatches(config.pp_schedule, config.pp_size)
        model._trainer_ext_full_shapes = shapes
        model._trainer_ext_pipeline = PipelineRuntime(
            model,
            stages,
            ids,
            num_stages,
            pp_mesh.get_group(),
            config.pp_schedule,
            microbatches,
            self.state.device,
            ranges,
            dtype,
        )
        self._remember(before, model)
        self._pipeline_models = [*self._kept_models(), model]
        logger.info("pipeline stages %s of %s (%s)", ids, num_stages, split.describe(ranges))
        return model

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point an optimizer built on the whole model at this rank's (sharded) parameters; the others' go. The
        whole model's order stays on it: an unsharded checkpoint's optimizer state is indexed by it."""
        order = [self._full_names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
        if all(order) and not hasattr(optimizer, "_trainer_ext_full_param_order"):
            optimizer._trainer_ext_full_param_order = order
        super().adopt_optimizer(optimizer)
        kept = {id(p) for model in self._kept_models() for p in model.parameters()}
        if not kept:
            return
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in kept]

    def _kept_models(self) -> list[torch.nn.Module]:
        return list(getattr(self, "_pipeline_models", []))

    def shards_model(self, model: Any) -> bool:
        return model is not None and (split.split_of(self.unwrap(model)) is not None or super().shards_model(model))

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip by the norm over every stage's gradients (and every shard's and tensor-parallel slice's); returns it,
        the same on all ranks."""
        params = [p for p in parameters if p.grad is not None]
        norm_type = float(norm_type)
        norm = total_grad_norm(params, norm_type)
        norm = norm.to(self.state.device, torch.promote_types(norm.dtype, torch.float32))
        group = self.parallel["pp"].get_group()
        if norm_type == float("inf"):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        else:
            norm = norm**norm_type
            dist.all_reduce(norm, group=group)
            norm = norm ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.mul_(coefficient.to(grad.device, grad.dtype))
        return norm

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        unwrapped = self.unwrap(model)
        if split.split_of(unwrapped) is None:
            return super().full_state_dict(model)
        return pipeline_checkpoint.gather_full_state(unwrapped, self.parallelism.non_data_parallel_size)

    def export_model(
        self, model: torch.nn.Module, directory: str | os.PathLike, *, max_shard_size: str | int, is_main_process: bool
    ) -> None:
        unwrapped = self.unwrap(model)
        if split.split_of(unwrapped) is None:
            return super().export_model(
                model, directory, max_shard_size=max_shard_size, is_main_process=is_main_process
            )
        stats = pipeline_checkpoint.export(
            unwrapped, directory, self.parallelism.non_data_parallel_size, max_shard_size=max_shard_size
        )
        logger.info("saved the consolidated model to %s (%d file(s))", directory, stats["files"])
        return None
