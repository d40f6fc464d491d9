"""The pipeline on one rank: its stage modules, a schedule per batch shape, and the steps the Trainer and loops
call — a training step (forward and backward of every microbatch, the loss reduced to every rank of the pipeline)
and an evaluation forward (loss and logits on every rank)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer_ext.distributed.pipeline import schedules
from trainer_ext.errors import ConfigError

_CACHED = 4  # schedules kept per runtime (one per batch shape: dynamic padding changes the sequence length)


class PipelineRuntime:
    """Runs ``stages`` (this rank's ``StageModule``s, stage indices ``stage_ids`` of ``num_stages``) over the pp
    process ``group`` with schedule ``schedule``, ``microbatches`` per run."""

    def __init__(
        self,
        model: nn.Module,
        stages: list[nn.Module],
        stage_ids: list[int],
        num_stages: int,
        group: Any,
        schedule: str,
        microbatches: int,
        device: torch.device,
        ranges: list[tuple[int, int]],
        dtype: torch.dtype,
    ) -> None:
        self.model, self.stages, self.stage_ids, self.num_stages = model, stages, stage_ids, num_stages
        self.group, self.schedule_name, self.microbatches, self.device = group, schedule, microbatches, device
        self.ranges = ranges
        self.dtype = dtype
        self.pp_size = dist.get_world_size(group)
        self.pp_rank = dist.get_rank(group)
        self.last_rank = dist.get_global_rank(group, schedules.owner_of_stage(schedule, num_stages - 1, self.pp_size))
        self._started: dict[int, bool] = {}
        self._schedules: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._num_items: torch.Tensor | float = 1.0
        self._scale = 1.0

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    # -- schedules ------------------------------------------------------------------------------
    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One microbatch's loss: the model's own loss summed over its tokens, over the step's token count."""
        config = self.model.config
        loss = self.model.loss_function(
            logits=logits, labels=labels, vocab_size=config.vocab_size, num_items_in_batch=self._num_items
        )
        return loss * self._scale

    def _schedule(self, key: tuple[Any, ...]) -> Any:
        """The training schedule for batches of ``key`` = (shape, has a mask), built on first use (torch's stages
        keep the shapes they were set up with)."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as torch_schedules

        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        rows, length = key[0]
        stages = [
            PipelineStage(
                module, index, self.num_stages, self.device, group=self.group, **self._metas(index, rows, length)
            )
            for module, index in zip(self.stages, self.stage_ids, strict=True)
        ]
        cls = getattr(torch_schedules, schedules.SCHEDULES[self.schedule_name][0])
        if schedules.stages_per_rank(self.schedule_name) == 1:
            built = cls(stages[0], self.microbatches, loss_fn=self._loss, scale_grads=False)
        else:
            built = cls(stages, self.microbatches, loss_fn=self._loss, scale_grads=False)
        self._schedules[key] = built
        while len(self._schedules) > _CACHED:
            _, dropped = self._schedules.popitem(last=False)
            self._started.pop(id(dropped), None)
        return built

    def _gradients(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """The gradients a schedule's first run clears: those of the stages' FSDP modules (torch resets them after
        setting the stages up); plain modules' gradients stay and accumulate in place."""
        from torch.distributed.fsdp import FSDPModule

        fsdp = {
            p for stage in self.stages for m in stage.modules() if isinstance(m, FSDPModule) for p in m.parameters()
        }
        return {p: p.grad for p in fsdp if p.grad is not None}

    def _metas(self, index: int, rows: int, length: int) -> dict[str, Any]:
        """Each stage's input and output shapes given up front (static mode): torch would otherwise infer them by a
        forward on meta tensors, which under FSDP gathers parameters on this data-parallel rank alone whenever its
        batch shape is new (the other replicas are not there: a hang)."""
        rows //= self.microbatches
        config = self.model.config
        hidden = torch.empty(rows, length, config.hidden_size, dtype=self.dtype, device="meta")
        logits = torch.empty(rows, length, config.vocab_size, dtype=self.dtype, device="meta")
        first = torch.empty(rows, length, dtype=torch.long, device="meta")
        # a received activation needs its gradient sent back: its meta says so
        inputs = first if index == 0 else hidden.clone().requires_grad_(True)
        metas = {"input_args": inputs, "output_args": logits if index == self.num_stages - 1 else hidden}
        if index > 0:
            metas["input_grads"] = hidden
        if index < self.num_stages - 1:
            metas["output_grads"] = hidden
        return metas

    def _padded(self, batch: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """The batch with rows added (labels ignored, keys masked) up to a multiple of the microbatch count, so every
        microbatch has one shape; and the real row count."""
        ids = batch["input_ids"]
        rows = ids.shape[0]
        extra = -rows % self.microbatches
        if rows < self.microbatches:
            extra = self.microbatches - rows
        out = dict(batch)
        out["position_ids"] = _positions(out.get("position_ids"), ids)
        if extra:
            pad = {"input_ids": 0, "labels": -100, "attention_mask": 0, "position_ids": 0}
            for name, value in pad.items():
                tensor = out.get(name)
                if tensor is None:
                    if name == "attention_mask":  # real rows attend everywhere, the added ones nowhere
                        tensor = torch.ones_like(ids)
                    else:
                        continue
                filler = tensor.new_full((extra, *tensor.shape[1:]), value)
                out[name] = torch.cat([tensor, filler])
        return out, rows

    def _check_columns(self, batch: dict[str, Any], train: bool) -> None:
        unknown = sorted(k for k, v in batch.items() if v is not None and k not in _INPUTS)
        if unknown:
            raise ConfigError(
                f"pipeline parallelism takes input_ids, attention_mask, position_ids and labels; this batch also has "
                f"{', '.join(unknown)}: drop those columns (remove_unused_columns) or set pp_size=1"
            )
        if batch.get("labels") is None and train:
            raise ConfigError("pipeline parallelism trains from labels (the last stage's loss): this batch has none")

    def _run(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """One training run of the schedule over ``batch``; the microbatches' losses on the last stage."""
        self._check_columns(batch, train=True)
        padded, _ = self._padded(batch)
        ids = padded["input_ids"]
        kwargs = {"position_ids": padded["position_ids"]}
        if padded.get("attention_mask") is not None:
            kwargs["attention_mask"] = padded["attention_mask"]
        schedule = self._schedule((tuple(ids.shape), "attention_mask" in kwargs))
        losses: list[torch.Tensor] = []
        target = padded["labels"] if self.has_last_stage else None
        args = (ids,) if self.has_first_stage else ()
        # a schedule's first run sets torch's stages up and clears the FSDP parameters' gradients: those of the
        # accumulation window's earlier steps are taken out before it and added back after it
        kept = {} if self._started.get(id(schedule)) else self._gradients()
        for parameter in kept:
            parameter.grad = None
        self._started[id(schedule)] = True
        schedule.step(*args, target=target, losses=losses, **kwargs)
        for parameter, grad in kept.items():
            parameter.grad = grad if parameter.grad is None else parameter.grad + grad
        return losses

    # -- the steps ------------------------------------------------------------------------------
    def train_step(
        self, batch: dict[str, Any], num_items_in_batch: torch.Tensor | float | None, scale: float = 1.0
    ) -> torch.Tensor:
        """Forward and backward of ``batch`` in microbatches; gradients accumulate in the stages' parameters.
        Returns the loss backward took (summed token losses over ``num_items_in_batch``, this batch's label count
        when None, times ``scale``), the same on every pipeline rank."""
        if num_items_in_batch is None:
            labels = batch["labels"][..., 1:]
            num_items_in_batch = labels.ne(-100).sum()
        self._num_items, self._scale = num_items_in_batch, scale
        return self._broadcast_loss(self._run(batch))

    @torch.no_grad()
    def eval_step(self, batch: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The loss (the model's own: a token mean over the batch, None without labels) and the logits, on every
        pipeline rank. The whole batch goes through the stages in order, each sending its output to the next one's
        rank: evaluation needs no schedule (and keeps none of the training schedules' state)."""
        self._check_columns(batch, train=False)
        ids = batch["input_ids"]
        rows, length = ids.shape
        kwargs = {"position_ids": _positions(batch.get("position_ids"), ids)}
        if batch.get("attention_mask") is not None:
            kwargs["attention_mask"] = batch["attention_mask"]
        owner = [schedules.owner_of_stage(self.schedule_name, s, self.pp_size) for s in range(self.num_stages)]
        config = self.model.config
        hidden = None
        for stage in range(self.num_stages):
            if owner[stage] != self.pp_rank:
                continue
            if stage == 0:
                hidden = ids
            elif owner[stage - 1] != self.pp_rank:
                hidden = torch.empty(rows, length, config.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(hidden, dist.get_global_rank(self.group, owner[stage - 1]), self.group)
            hidden = self.stages[self.stage_ids.index(stage)](hidden, **kwargs)
            if stage < self.num_stages - 1 and owner[stage + 1] != self.pp_rank:
                dist.send(
                    hidden.to(self.dtype).contiguous(), dist.get_global_rank(self.group, owner[stage + 1]), self.group
                )
        labels = batch.get("labels")
        loss = None
        if self.has_last_stage:
            logits = hidden.to(self.dtype).contiguous()
            if labels is not None:
                loss = self.model.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size)
        else:
            logits = torch.empty(rows, length, config.vocab_size, dtype=self.dtype, device=self.device)
        dist.broadcast(logits, self.last_rank, self.group)
        if labels is not None:
            loss = (loss.detach().float() if loss is not None else torch.zeros((), device=self.device)).contiguous()
            dist.broadcast(loss, self.last_rank, self.group)
        return loss, logits

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if self.has_last_stage:
            total = torch.stack([loss.detach().float() for loss in losses]).sum()
        else:
            total = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(total, self.last_rank, self.group)
        return total


_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "labels"})


def _positions(position_ids: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """Positions for every row: the batch's own (one row broadcast to all), or 0 … length − 1."""
    rows, length = ids.shape
    if position_ids is None:
        return torch.arange(length, device=ids.device)[None].expand(rows, -1)
    return position_ids.expand(rows, -1) if position_ids.shape[0] != rows else position_ids
