"""FSDP2 jobs on real gloo ranks (torchrun), compared by test_fsdp.py.

``python -m tests.distributed.strategies.fsdp_jobs OUT two`` (2 ranks): DDP and several FSDP2 set-ups on the
same data, per-rank parameter storage, an interrupted + resumed FSDP run, the consolidated export.
``… OUT from_one CKPT`` (2 ranks): resume under FSDP from a checkpoint written by one process without FSDP;
``loop`` (2 ranks): hand-written trainer_ext.Accelerator loops; ``order`` (2 ranks): ``prepare`` given the model after its optimizer;
``two_models`` (2 ranks): two models prepared one after the other, each after its own optimizer; ``plugin`` (2
ranks): accelerate's ``FullyShardedDataParallelPlugin`` against ``fsdp_config`` and the launcher's settings. Rank 0 writes
the full weights (gathered) and ``results.json`` to OUT.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from tests.helpers.jobs import StopAt, make_args
from tests.helpers.paths import CONFIGS
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.checkpointing.sharded import full_state_dict

STEPS_DATA = 32  # samples: 8 optimizer steps of a global batch of 4 per epoch, 2 epochs
STOP = 6
FSDP = {"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
VARIANTS = {
    "full_shard": FSDP,
    "shard_grad_op": {"fsdp": "shard_grad_op", "fsdp_config": {}},
    "size_wrap_checkpointed": {
        "fsdp": True,
        "fsdp_config": {
            "auto_wrap_policy": "SIZE_BASED_WRAP",
            "min_num_params": 2000,
            "activation_checkpointing": True,
        },
    },
    "cpu_offload": {"fsdp": "full_shard offload", "fsdp_config": {}},
    "hybrid_2x1": {"fsdp": True, "fsdp_config": {"sharding_strategy": "HYBRID_SHARD", "replicate_size": 2}},
}


def train(out: Path, extra: dict, **overrides) -> tuple[Trainer, list[float]]:
    args = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "num_train_epochs": 2, **overrides}
    trainer = Trainer(
        model=tiny_llama(0), args=make_args(out, **extra, **args), train_dataset=lm_dataset(STEPS_DATA, seed=7)
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses


def gathered(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Full weights on rank 0 (a collective for sharded models)."""
    return full_state_dict(trainer.accelerator.unwrap_model(trainer.model_wrapped))


def storage(trainer: Trainer) -> dict[str, int]:
    """Bytes of parameters this rank holds (its shards) against the full model's."""
    model = trainer.model_wrapped
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"local": local, "full": full}


def two(out: Path) -> None:
    result: dict = {"losses": {}, "grad_norms": {}}
    tensors: dict[str, dict[str, torch.Tensor]] = {}

    ddp, result["losses"]["ddp"] = train(out / "ddp", {}, gradient_accumulation_steps=2, per_device_train_batch_size=1)
    tensors["ddp"] = gathered(ddp)
    del ddp
    for name, extra in VARIANTS.items():
        trainer, result["losses"][name] = train(
            out / name, extra, gradient_accumulation_steps=2, per_device_train_batch_size=1
        )
        tensors[name] = gathered(trainer)
        result["grad_norms"][name] = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
        if name == "full_shard":
            result["storage"] = storage(trainer)
            stats = trainer_export(trainer, out / "export")
            result["export"] = stats
            probe = torch.tensor([[5, 6, 7, 8, 9, 10]])
            with torch.no_grad():
                result["logits"] = trainer.model_wrapped(input_ids=probe).logits.tolist()
            result["unsharded_after_forward"] = unsharded_after_forward(trainer.model_wrapped, probe)
        del trainer

    bf16, result["losses"]["bf16"] = train(out / "bf16", FSDP, bf16=True)  # bf16 parameters in forward/backward
    result["bf16_param_dtype"] = str(bf16.model_wrapped.model.layers[0].mlp.down_proj.weight.dtype)
    del bf16

    # interrupted at STOP (sharded checkpoint) then resumed on the same 2 ranks, against uninterrupted
    save = dict(save_strategy="steps", save_steps=STOP)
    full, _ = train(out / "resume_full", FSDP, **save)
    tensors["resume_full"] = gathered(full)
    part = Trainer(
        model=tiny_llama(0),
        args=make_args(out / "resume_part", **FSDP, **save, per_device_train_batch_size=2, num_train_epochs=2),
        train_dataset=lm_dataset(STEPS_DATA, seed=7),
        callbacks=[StopAt(STOP)],
    )
    part.train()
    again = Trainer(
        model=tiny_llama(0),
        args=make_args(out / "resume_part", **FSDP, **save, per_device_train_batch_size=2, num_train_epochs=2),
        train_dataset=lm_dataset(STEPS_DATA, seed=7),
    )
    again.train(resume_from_checkpoint=str(out / "resume_part" / f"checkpoint-{STOP}"))
    tensors["resumed"] = gathered(again)
    result["resume_steps"] = [full.state.global_step, again.state.global_step]
    if dist.get_rank() == 0:
        for name, values in tensors.items():
            save_file({k: v.contiguous() for k, v in values.items()}, str(out / f"{name}.safetensors"))
        (out / "results.json").write_text(json.dumps(result, indent=1))


def unsharded_after_forward(model: torch.nn.Module, probe: torch.Tensor) -> dict[str, bool]:
    """Which units keep their parameters gathered between forward and backward (FSDP2 registers the unsharded
    parameters then): the root should, as torch's default has it, so backward needs no second all-gather."""
    from torch.distributed.tensor import DTensor

    logits = model(input_ids=probe).logits
    kept = {
        "root": not isinstance(model.lm_head.weight, DTensor),
        "layer": not isinstance(model.model.layers[0].mlp.down_proj.weight, DTensor),
    }
    logits.sum().backward()
    model.zero_grad(set_to_none=True)
    return kept


def trainer_export(trainer: Trainer, folder: Path) -> dict:
    trainer.export_max_shard_size = 40_000  # bytes: several files, so no file holds the whole model
    trainer.save_model(str(folder))
    return {"files": sorted(p.name for p in folder.glob("*.safetensors"))} if dist.get_rank() == 0 else {}


def loop(out: Path) -> None:
    """trainer_ext.Accelerator hand-written loops: DDP vs FSDP, FSDP save_state/load_state, FSDP save_model."""
    from tests.helpers.loops import train_loop

    config = FSDP["fsdp_config"]
    _, ddp, _ = train_loop(per_device_batch=1, grad_accum=2)
    accelerator, fsdp, _ = train_loop(per_device_batch=1, grad_accum=2, fsdp_config=config)
    accelerator.save_model(accelerator.engine._models[0], out / "loop_export", max_shard_size=40_000)
    _, part, _ = train_loop(
        per_device_batch=1, grad_accum=2, stop_after=8, save_to=out / "loop_state", fsdp_config=config
    )
    _, resumed, _ = train_loop(per_device_batch=1, grad_accum=2, resume_from=out / "loop_state", fsdp_config=config)
    if dist.get_rank() == 0:
        for name, values in (("loop_ddp", ddp), ("loop_fsdp", fsdp), ("loop_resumed", resumed)):
            save_file(values, str(out / f"{name}.safetensors"))
        kind = accelerator.distributed_type
        (out / "loop.json").write_text(json.dumps({"distributed_type": str(getattr(kind, "value", kind))}))


def plugin(out: Path) -> None:
    """accelerate's ``FullyShardedDataParallelPlugin``: the same training as the equivalent ``fsdp_config``, and as
    the settings ``trainer-ext launch --fsdp_config`` exports to an ``Accelerator()`` that names none."""
    from torch.distributed.fsdp import FSDPModule

    from tests.helpers.loops import train_loop
    from trainer_ext import Accelerator, FullyShardedDataParallelPlugin
    from trainer_ext.env_vars import FSDP_CONFIG

    def wrapped(accelerator: Accelerator) -> list[str]:
        model = accelerator.unwrap_model(accelerator.engine._models[0])
        return [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]

    layers = ["LlamaDecoderLayer"]
    fields = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": layers}
    by_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False, **fields)
    accelerator, tensors, _ = train_loop(per_device_batch=1, grad_accum=2, fsdp_plugin=by_plugin)
    result = {
        "by_plugin": {"wrapped": wrapped(accelerator), "same_plugin": accelerator.state.fsdp_plugin is by_plugin}
    }
    config = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_layer_cls_to_wrap": layers}
    by_config = train_loop(per_device_batch=1, grad_accum=2, fsdp_config={**config, "reshard_after_forward": False})
    os.environ[FSDP_CONFIG] = json.dumps({"reshard_after_forward": False, "transformer_layer_cls_to_wrap": layers})
    try:
        accelerator, launched, _ = train_loop(per_device_batch=1, grad_accum=2)
        shown = accelerator.state.fsdp_plugin
        result["launched"] = {
            "wrapped": wrapped(accelerator),
            "reshard_after_forward": shown.reshard_after_forward,
            "auto_wrap_policy": shown.auto_wrap_policy.__name__,
        }
        try:
            Accelerator(cpu=True, deepspeed_config=str(CONFIGS / "deepspeed" / "zero2.json"))
        except Exception as error:  # noqa: BLE001  (recorded and checked)
            result["launched"]["with_deepspeed"] = f"{type(error).__name__}: {error}"
    finally:
        del os.environ[FSDP_CONFIG]
    default = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    default.prepare(tiny_llama(0))
    result["default_wraps"] = wrapped(default)
    if dist.get_rank() == 0:
        for name, values in (("by_plugin", tensors), ("by_config", by_config[1]), ("launched", launched)):
            save_file({k: v.float().contiguous() for k, v in values.items()}, str(out / f"plugin_{name}.safetensors"))
        (out / "plugin.json").write_text(json.dumps(result))


REORDERED = ("optimizer", "loader", "model", "scheduler")


def order(out: Path) -> None:
    """``prepare(optimizer, loader, model, scheduler)``: under FSDP (and DeepSpeed ZeRO-2 when installed) the same
    training as the model-first order; an optimizer prepared in an earlier call than its model still trains."""
    from tests.helpers.loops import train_loop

    config = FSDP["fsdp_config"]
    tensors = {
        "order_fsdp": train_loop(per_device_batch=1, grad_accum=2, fsdp_config=config)[1],
        "order_fsdp_reordered": train_loop(per_device_batch=1, grad_accum=2, fsdp_config=config, order=REORDERED)[1],
    }
    result = {"separate_calls_changed": separate_calls(config)}
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        result["deepspeed"] = False
    else:
        result["deepspeed"] = True
        ds = str(CONFIGS / "deepspeed" / "zero2.json")
        for name, kwargs in (("order_ds", {}), ("order_ds_reordered", {"order": REORDERED})):
            accelerator, tensors[name], _ = train_loop(per_device_batch=1, grad_accum=2, deepspeed_config=ds, **kwargs)
            accelerator.engine.free_memory()
    if dist.get_rank() == 0:
        for name, values in tensors.items():
            save_file({k: v.float().contiguous() for k, v in values.items()}, str(out / f"{name}.safetensors"))
        (out / "order.json").write_text(json.dumps(result))


def separate_calls(fsdp_config: dict) -> list[int]:
    """``prepare(optimizer)`` then ``prepare(model)``: parameters changed by one step, out of all of them."""
    from trainer_ext import Accelerator

    accelerator = Accelerator(cpu=True, fsdp_config=fsdp_config)
    model = tiny_llama(0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    model = accelerator.prepare(model)
    accelerator.backward(model(input_ids=torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss)
    optimizer.step()
    after = accelerator.get_state_dict(model)
    return [sum(not torch.equal(after[n], before[n]) for n in before), len(before)] if after else []


def two_models(out: Path) -> None:
    """Two models in turn, each as ``prepare(optimizer)`` then ``prepare(model)``: what each optimizer steps.

    The first model's unsharded parameters are freed once its optimizer follows the shards, and the second
    model's new parameters may reuse their ids: the optimizers must still follow their own model only.
    """
    from trainer_ext import Accelerator

    accelerator = Accelerator(cpu=True, fsdp_config=FSDP["fsdp_config"])
    models, optimizers = [], []
    for seed in (0, 1):
        model = tiny_llama(seed)
        optimizers.append(accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1)))
        models.append(accelerator.prepare(model))
        del model
    tokens = torch.tensor([[5, 6, 7, 8]])
    result: dict = {"own": [], "changed": []}
    for model, optimizer in zip(models, optimizers, strict=True):
        held = {id(p) for group in optimizer.optimizer.param_groups for p in group["params"]}
        result["own"].append(held == {id(p) for p in model.parameters()})
    for i, optimizer in enumerate(optimizers):  # one step of optimizer i: which models' shards move
        before = [[p.detach().to_local().clone() for p in m.parameters()] for m in models]
        accelerator.backward(models[i](input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
        moved = [
            sum(not torch.equal(p.detach().to_local(), b) for p, b in zip(m.parameters(), old, strict=True))
            for m, old in zip(models, before, strict=True)
        ]
        result["changed"].append(moved)
    result["total"] = len(list(models[0].parameters()))
    if dist.get_rank() == 0:
        (out / "two_models.json").write_text(json.dumps(result))


def hybrid(out: Path) -> None:
    """4 ranks: DDP against the hybrid_shard preset on a 2 x 2 mesh (2 replicas of 2 shards).

    One machine here, so replicate_size (default: the number of machines) is set to 2 explicitly.
    """
    from trainer_ext.distributed.strategies.fsdp.config import read_fsdp_config

    path = CONFIGS / "fsdp" / "hybrid_shard.yaml"
    preset = {**read_fsdp_config(path), "replicate_size": 2}
    ddp, ddp_losses = train(out / "ddp4", {}, per_device_train_batch_size=1)
    reference = gathered(ddp)
    del ddp
    hsdp, hsdp_losses = train(out / "hsdp", {"fsdp": True, "fsdp_config": preset}, per_device_train_batch_size=1)
    values = gathered(hsdp)
    mesh = hsdp.accelerator.strategy.mesh()
    result = {"mesh": list(mesh.shape), "storage": storage(hsdp), "losses": [ddp_losses, hsdp_losses]}
    if dist.get_rank() == 0:
        save_file(reference, str(out / "ddp4.safetensors"))
        save_file(values, str(out / "hsdp.safetensors"))
        (out / "hybrid.json").write_text(json.dumps(result))


def from_one(out: Path, checkpoint: str) -> None:
    """Resume under FSDP (2 ranks x batch 2) from a 1-process checkpoint (batch 2 x accumulation 2)."""
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(checkpoint.rsplit("/", 1)[0], **FSDP, per_device_train_batch_size=2, num_train_epochs=2),
        train_dataset=lm_dataset(STEPS_DATA, seed=7),
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    values = gathered(trainer)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in values.items()}, str(out / "from_one.safetensors"))
        (out / "from_one.json").write_text(json.dumps({"steps": trainer.state.global_step}))


if __name__ == "__main__":
    target, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "two":
        two(target)
    elif mode == "loop":
        loop(target)
    elif mode == "order":
        order(target)
    elif mode == "hybrid":
        hybrid(target)
    elif mode == "two_models":
        two_models(target)
    elif mode == "plugin":
        plugin(target)
    else:
        from_one(target, sys.argv[3])
    dist.barrier()
    if int(os.environ.get("RANK", "0")) == 0:
        print("done")
