"""A prepared LR scheduler: accelerate's stepping rule, and trainer_ext's opt-in alternative."""

from __future__ import annotations

from typing import Any

import torch


class PreparedScheduler:
    """A prepared LR scheduler: it steps only when the optimizers did (not inside an accumulation window, not when
    the fp16 scaler skipped the step), and then as accelerate does, ``num_processes`` times unless batches are
    split (so a schedule sized from the unsharded loader ends on time), or once with
    ``scheduler_counts_optimizer_steps``."""

    def __init__(self, scheduler: Any, accelerator: Any, step_with_optimizer: bool = True) -> None:
        self.scheduler = scheduler
        self.accelerator = accelerator
        self.step_with_optimizer = step_with_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        acc = self.accelerator
        if not acc.sync_gradients:  # inside an accumulation window
            if acc.gradient_state.plugin_kwargs.get("adjust_scheduler", False):  # accelerate's reading
                self.scheduler._step_count += 1  # bookkeeping only: the LR itself does not move
            return
        if acc.optimizer_step_was_skipped:
            return
        once = acc.split_batches or acc.scheduler_counts_optimizer_steps
        # once per data-parallel rank: ranks of one tensor-parallel group read the same batches
        for _ in range(1 if once else acc.engine.num_data_parallel_processes):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR refuses to step past its end
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        return self.scheduler.print_lr(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or hasattr(obj, "get_last_lr")
