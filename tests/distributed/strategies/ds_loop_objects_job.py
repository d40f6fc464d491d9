"""accelerate's DeepSpeed placeholders in a hand-written loop, on one gloo rank under the launcher (DeepSpeed on CPU).

``python -m tests.distributed.strategies.ds_loop_objects_job OUT_DIR`` writes ``results.json``: what each combination
of optimizer/scheduler objects and config blocks did (accepted, or the error's type and message), and the LRs of
a loop whose scheduler DeepSpeed builds through ``DummyScheduler(lr_scheduler_callable=...)``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer_ext import Accelerator, DeepSpeedPlugin, DummyOptim, DummyScheduler, InitProcessGroupKwargs

ZERO2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"}
OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}
STEPS = 4


class FakeScheduler:
    """Anything with ``step`` and ``get_last_lr`` is a scheduler to ``prepare`` (a user's own class)."""

    def step(self) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return [0.0]


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def outcome(config: dict[str, Any], make: Any) -> dict[str, Any]:
    """Prepare what ``make(model)`` returns with a fresh Accelerator on ``config``: accepted, or the error."""
    accelerator = Accelerator(deepspeed_config=config, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = torch.nn.Linear(4, 1)
    try:
        prepared = accelerator.prepare(model, *make(model), data())
    except Exception as exc:  # noqa: BLE001  (recorded for the test)
        return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        accelerator.engine.free_memory()
    return {"accepted": [type(obj).__name__ for obj in prepared], "lr": prepared[1].param_groups[0]["lr"]}


def refusals() -> dict[str, Any]:
    blocks = {**ZERO2, "optimizer": OPTIMIZER, "scheduler": SCHEDULER}
    optimizer_only = {**ZERO2, "optimizer": OPTIMIZER}
    explicit_lr = {**ZERO2, "optimizer": {**OPTIMIZER, "params": {**OPTIMIZER["params"], "lr": 0.5}}}
    return {
        "torch_optimizer_with_block": outcome(blocks, lambda m: [torch.optim.AdamW(m.parameters())]),
        "dummy_optimizer_without_block": outcome(ZERO2, lambda m: [DummyOptim(m.parameters())]),
        "torch_scheduler_with_block": outcome(
            {**ZERO2, "scheduler": SCHEDULER},
            lambda m: [torch.optim.AdamW(m.parameters()), FakeScheduler()],
        ),
        "dummy_scheduler_without_block_or_callable": outcome(
            optimizer_only, lambda m: [d := DummyOptim(m.parameters()), DummyScheduler(d)]
        ),
        "dummy_optimizer_with_own_scheduler": outcome(
            optimizer_only, lambda m: [DummyOptim(m.parameters()), FakeScheduler()]
        ),
        "explicit_lr_is_the_configs": outcome(explicit_lr, lambda m: [DummyOptim(m.parameters(), lr=0.1)]),
        "both_blocks": outcome(blocks, lambda m: [d := DummyOptim(m.parameters()), DummyScheduler(d, 8, 2)]),
    }


def callable_schedule() -> dict[str, Any]:
    """The config's optimizer, a scheduler built on it by the loop's callable; DeepSpeed steps it."""
    plugin = DeepSpeedPlugin(hf_ds_config={**ZERO2, "optimizer": OPTIMIZER})
    accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    config_seen = accelerator.state.deepspeed_plugin.deepspeed_config  # read before prepare, as scripts do
    model = torch.nn.Linear(4, 1)
    optimizer = DummyOptim(model.parameters(), lr=0.1)
    scheduler = DummyScheduler(
        optimizer, lr_scheduler_callable=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, data(), scheduler)
    lrs = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()  # DeepSpeed stepped it already: this does nothing
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    result = {
        "lrs": lrs,
        "optimizer_lr": config_seen["optimizer"]["params"]["lr"],
        "micro_batch": config_seen["train_micro_batch_size_per_gpu"],
        "scheduler": type(scheduler).__name__,
        "zero_stage": accelerator.deepspeed_plugin.zero_stage,
    }
    accelerator.engine.free_memory()
    return result


def main(out: Path) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    results = {"refusals": refusals(), "callable": callable_schedule()}
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
