"""DeepSpeed loops written as accelerate's ``by_feature/deepspeed_with_config_support.py`` writes them.

The script configures DeepSpeed with a ``DeepSpeedPlugin`` (``hf_ds_config``: a config dict) and picks its optimizer
and scheduler from what the config holds: ``DummyOptim``/``DummyScheduler`` stand for the config's ``optimizer``
and ``scheduler`` blocks (phase ``config_blocks``), torch objects are used where it has none (phase
``torch_objects``). Both phases first try the combination accelerate refuses and record its error. DeepSpeed runs on
the CPU (``DS_ACCELERATOR=cpu``, torch's Adam).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from transformers import get_linear_schedule_with_warmup

from .scenarios_train import EPOCHS, EVAL_N, SEED, TRAIN_N, fit
from .workload import Context, RegressionModel, loader

BATCH = 4
LR = 1e-2
ZERO2 = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
}
BLOCKS = {
    # accelerate fills lr and weight_decay from the DummyOptim; DeepSpeed's own Adam needs a compiled op, torch's not
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
}
RESOLVED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "scheduler",
)


def _refusal(exc: BaseException) -> dict[str, Any]:
    """What a user reads first: a ValueError and its opening sentence (ours adds how to fix it after a colon)."""
    head = str(exc).split(". ")[0].split(": ")[0].rstrip(".")
    return {"value_error": isinstance(exc, ValueError), "head": head}


def _try_prepare(accelerator: Any, *objects: Any) -> dict[str, Any]:
    try:
        accelerator.prepare(*objects)
    except Exception as exc:  # noqa: BLE001  (recorded and compared)
        return _refusal(exc)
    return {"accepted": True}


def _grouped(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The examples' two parameter groups: weight decay on weights, none on biases."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.01},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def deepspeed_config_support(ctx: Context) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with_blocks = ctx.phase == "config_blocks"
    config = {**copy.deepcopy(ZERO2), **(copy.deepcopy(BLOCKS) if with_blocks else {})}
    plugin = ctx.api.DeepSpeedPlugin(hf_ds_config=config)
    # DeepSpeed needs cpu=False; on a machine without GPU accelerate then counts the processes only when told gloo
    gloo = ctx.api.InitProcessGroupKwargs(backend="gloo")
    accelerator = ctx.api.Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[gloo])
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    ctx.rec.put(
        "plugin",
        {
            "zero_stage": accelerator.state.deepspeed_plugin.zero_stage,
            "has_optimizer_block": "optimizer" in ds_config,
            "has_scheduler_block": "scheduler" in ds_config,
            "distributed_type": str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)),
            "same_plugin": accelerator.deepspeed_plugin is accelerator.state.deepspeed_plugin,
        },
    )
    ctx.api.set_seed(SEED)
    train_dl = loader(TRAIN_N, BATCH, shuffle=True)
    eval_dl = loader(EVAL_N, BATCH, seed=99)
    model = RegressionModel()
    total = len(train_dl) * EPOCHS  # before prepare: the unsharded length, as the example computes it
    # the example's choice: the config's optimizer if it has one, else a torch one
    optimizer_cls = torch.optim.AdamW if "optimizer" not in ds_config else ctx.api.DummyOptim
    if with_blocks:
        refused = _try_prepare(accelerator, model, torch.optim.AdamW(model.parameters()), train_dl)
        ctx.rec.put("code_optimizer_with_block", refused)
    else:
        refused = _try_prepare(accelerator, model, ctx.api.DummyOptim(model.parameters()), train_dl)
        ctx.rec.put("dummy_optimizer_without_block", refused)
    optimizer = optimizer_cls(_grouped(model), lr=LR)
    if "scheduler" not in ds_config:
        scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=total)
    else:
        scheduler = ctx.api.DummyScheduler(optimizer, total_num_steps=total, warmup_num_steps=2)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler
    )
    # the dict read before prepare is the plugin's own: prepare filled its "auto" values in place
    ctx.rec.put("resolved", {key: ds_config.get(key) for key in RESOLVED_KEYS})
    ctx.rec.put("len_train_dl", len(train_dl))
    fit(ctx, accelerator, (model, optimizer, train_dl, eval_dl, scheduler), evaluate_each_epoch=False)
