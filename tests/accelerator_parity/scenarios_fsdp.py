"""FSDP loops written for accelerate: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(...))``.

The plugin is built as accelerate's FSDP guide builds it (FSDP2, a state dict type, a wrap policy); the script
records the plugin's fields as its constructor left them, the errors of the settings accelerate refuses, then
trains, evaluates and gathers the whole model with ``get_state_dict`` (the guide's way to save an FSDP model).
Phase ``full_shard`` wraps each ``Linear`` (transformer-based wrap by class name), ``shard_grad_op`` keeps the
parameters gathered after forward and wraps nothing but the root.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import get_linear_schedule_with_warmup

from .scenarios_deepspeed import _refusal
from .scenarios_train import EPOCHS, EVAL_N, SEED, TRAIN_N
from .workload import Context, Epoch, RegressionModel, evaluate, loader, train_epoch

BATCH = 4
LR = 1e-2
PHASES = {
    "full_shard": {
        "reshard_after_forward": True,
        "auto_wrap_policy": "transformer_based_wrap",
        "transformer_cls_names_to_wrap": ["Linear"],
        "state_dict_type": "SHARDED_STATE_DICT",
    },
    "shard_grad_op": {"reshard_after_forward": False, "auto_wrap_policy": "no_wrap"},
}
REFUSED = {
    "forward_prefetch": {"fsdp_version": 2, "reshard_after_forward": True, "forward_prefetch": True},
    "local_state_dict": {"fsdp_version": 2, "reshard_after_forward": True, "state_dict_type": "LOCAL_STATE_DICT"},
    "sharding_strategy_alone": {"fsdp_version": 2, "sharding_strategy": "FULL_SHARD"},
}


def _name(value: Any) -> Any:
    """A field as JSON: enums by name, torch objects by class, functions by name."""
    if value is None or isinstance(value, bool | int | float | str | list):
        return value
    if hasattr(value, "name") and not callable(value):
        return value.name
    return getattr(value, "__name__", type(value).__name__)


def _fields(plugin: Any) -> dict[str, Any]:
    names = (
        "fsdp_version",
        "reshard_after_forward",
        "auto_wrap_policy",
        "transformer_cls_names_to_wrap",
        "min_num_params",
        "cpu_offload",
        "state_dict_type",
        "state_dict_config",
        "optim_state_dict_config",
        "activation_checkpointing",
        "activation_checkpointing_offload",
        "mixed_precision_policy",
        "use_orig_params",
        "sync_module_states",
        "backward_prefetch",
        "forward_prefetch",
        "limit_all_gathers",
        "cpu_ram_efficient_loading",
    )
    return {name: _name(getattr(plugin, name)) for name in names}


def _construct(ctx: Context, **kwargs: Any) -> dict[str, Any]:
    try:
        ctx.api.FullyShardedDataParallelPlugin(**kwargs)
    except Exception as exc:  # noqa: BLE001  (recorded and compared)
        return _refusal(exc)
    return {"accepted": True}


def fsdp_plugin(ctx: Context) -> None:
    settings = PHASES[ctx.phase]
    plugin = ctx.api.FullyShardedDataParallelPlugin(fsdp_version=2, **settings)
    ctx.rec.put("plugin", _fields(plugin))
    if ctx.phase == "full_shard":
        ctx.rec.put("refused", {name: _construct(ctx, **kwargs) for name, kwargs in REFUSED.items()})
        try:
            ctx.api.Accelerator(cpu=True, fsdp_plugin=object())
            ctx.rec.put("not_a_plugin", {"accepted": True})
        except Exception as exc:  # noqa: BLE001
            ctx.rec.put("not_a_plugin", {**_refusal(exc), "type_error": isinstance(exc, TypeError)})
        plugin.set_state_dict_type("FULL_STATE_DICT")
        ctx.rec.put("after_set_state_dict_type", _fields(plugin))
        plugin.set_state_dict_type("SHARDED_STATE_DICT")
    accelerator = ctx.api.Accelerator(cpu=True, fsdp_plugin=plugin)
    ctx.rec.put(
        "topology",
        {
            "distributed_type": str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)),
            "is_fsdp2": accelerator.is_fsdp2,
            # accelerate sets state.fsdp_plugin only where it runs FSDP (GPUs); elsewhere reading it raises
            "state_plugin_is_ours": getattr(accelerator.state, "fsdp_plugin", None) is plugin,
        },
    )
    ctx.api.set_seed(SEED)
    train_dl = loader(TRAIN_N, BATCH, shuffle=True)
    eval_dl = loader(EVAL_N, BATCH, seed=99)
    model = RegressionModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=2, num_training_steps=len(train_dl) * EPOCHS
    )
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler
    )
    for epoch in range(EPOCHS):
        train_epoch(accelerator, model, optimizer, train_dl, scheduler, Epoch(ctx.rec, epoch))
    evaluate(accelerator, model, eval_dl, ctx.rec, EVAL_N)
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(model)  # the whole model (on the main process at least), as the guide saves it
    if accelerator.is_main_process:
        ctx.rec.tensors("final", {k: v.detach().float().cpu() for k, v in state.items()})
    accelerator.end_training()
