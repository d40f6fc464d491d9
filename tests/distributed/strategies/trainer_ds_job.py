"""The Trainer with ``--deepspeed`` presets on 2 gloo ranks (DS_ACCELERATOR=cpu), against the DDP Trainer.

``python -m tests.distributed.strategies.trainer_ds_job OUT`` (under torchrun): every preset trains the same data as DDP; ZeRO-3 also stops
and resumes, exports the model, and builds a model partitioned in ``from_pretrained``. Rank 0 writes the
weights (consolidated) and ``results.json`` to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from tests.helpers.jobs import StopAt, make_args
from tests.helpers.paths import CONFIGS
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer

PRESETS = ("zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
STOP = 4
PROBE = [[5, 6, 7, 8, 9, 10]]


def run(out: Path, preset: str | None, model: torch.nn.Module | None = None, **overrides) -> Trainer:
    extra = {"deepspeed": str(CONFIGS / "deepspeed" / f"{preset}.json")} if preset else {}
    args = make_args(
        out, per_device_train_batch_size=1, gradient_accumulation_steps=2, num_train_epochs=1, **extra, **overrides
    )
    trainer = Trainer(
        model=model if model is not None else tiny_llama(0), args=args, train_dataset=lm_dataset(32, seed=7)
    )
    return trainer


def consolidated(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.float().contiguous() for k, v in trainer.accelerator.get_state_dict(trainer.model_wrapped).items()}


def losses(trainer: Trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def main(out: Path) -> None:
    results: dict = {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    ddp = run(out / "ddp", None)
    ddp.train()
    tensors["ddp"], results["ddp"] = {k: v.contiguous() for k, v in ddp.model.state_dict().items()}, losses(ddp)
    for preset in PRESETS:
        trainer = run(out / preset, preset)
        trainer.train()
        tensors[preset] = consolidated(trainer)
        norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
        results[preset] = {"losses": losses(trainer), "grad_norms": norms}
        if preset == "zero3":
            trainer.save_model(str(out / "export"))
            with torch.no_grad():
                results["zero3_logits"] = trainer.model_wrapped(input_ids=torch.tensor(PROBE)).logits.tolist()
        trainer.accelerator.free_memory()

    # optimizer and scheduler blocks in the JSON: DeepSpeed builds and steps both, the Trainer's are not used
    blocks = json.loads((CONFIGS / "deepspeed" / "zero2.json").read_text())
    blocks["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}
    blocks["scheduler"] = {
        "type": "WarmupDecayLR",
        "params": {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")},
    }
    (out / "blocks.json").write_text(json.dumps(blocks))
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(
            out / "blocks",
            per_device_train_batch_size=1,
            gradient_accumulation_steps=2,
            num_train_epochs=1,
            deepspeed=str(out / "blocks.json"),
        ),
        train_dataset=lm_dataset(32, seed=7),
    )
    trainer.train()
    results["blocks"] = {
        "losses": losses(trainer),
        "lrs": [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e],
        "optimizer": type(trainer.accelerator.strategy.engine.optimizer).__name__,
        "scheduler": type(trainer.lr_scheduler).__name__,
    }
    trainer.accelerator.free_memory()

    # ZeRO-3: stop at STOP (DeepSpeed checkpoint), resume from it, against the uninterrupted zero3 run above
    save = {"save_strategy": "steps", "save_steps": STOP}
    part = run(out / "resume", "zero3", **save)
    part.add_callback(StopAt(STOP))
    part.train()
    resumed = run(out / "resume", "zero3", **save)
    resumed.train(resume_from_checkpoint=str(out / "resume" / f"checkpoint-{STOP}"))
    tensors["zero3_resumed"] = consolidated(resumed)
    results["resume_steps"] = resumed.state.global_step

    # from_pretrained after the arguments: the model is built partitioned (ZeRO-3)
    if dist.get_rank() == 0:
        tiny_llama(0).save_pretrained(out / "base")
    dist.barrier()
    args = make_args(out / "partitioned", deepspeed=str(CONFIGS / "deepspeed" / "zero3.json"))
    model = LlamaForCausalLM.from_pretrained(out / "base")  # while the arguments (and their config) live
    del args
    results["partitioned"] = {
        "local_numel": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters()),
        "full_numel": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
        "has_ds_shape": all(hasattr(p, "ds_shape") for p in model.parameters()),
    }
    if dist.get_rank() == 0:
        for name, values in tensors.items():
            save_file(values, str(out / f"{name}.safetensors"))
        (out / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()


def loop(out: Path) -> None:
    """trainer_ext.Accelerator(deepspeed_config=...) in the hand-written loop of tests/helpers/loops.py."""
    from tests.helpers.loops import train_loop

    tensors = {"loop_ddp": train_loop(per_device_batch=1, grad_accum=2)[1]}
    for preset in ("zero2", "zero3"):
        config = str(CONFIGS / "deepspeed" / f"{preset}.json")
        accelerator, tensors[f"loop_{preset}"], _ = train_loop(
            per_device_batch=1, grad_accum=2, deepspeed_config=config
        )
        if preset == "zero3":
            accelerator.save_model(accelerator.engine._models[0], out / "loop_export")
            kind = accelerator.distributed_type
        accelerator.engine.free_memory()
    config = str(CONFIGS / "deepspeed" / "zero3.json")
    train_loop(per_device_batch=1, grad_accum=2, stop_after=8, save_to=out / "loop_state", deepspeed_config=config)
    tensors["loop_resumed"] = train_loop(
        per_device_batch=1, grad_accum=2, resume_from=out / "loop_state", deepspeed_config=config
    )[1]
    if dist.get_rank() == 0:
        for name, values in tensors.items():
            save_file({k: v.float().contiguous() for k, v in values.items()}, str(out / f"{name}.safetensors"))
        (out / "loop.json").write_text(json.dumps({"distributed_type": str(getattr(kind, "value", kind))}))
    dist.barrier()


if __name__ == "__main__":
    loop(Path(sys.argv[1])) if sys.argv[2:] == ["loop"] else main(Path(sys.argv[1]))
