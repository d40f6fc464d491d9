"""A LoRA job under DDP, FSDP2 or DeepSpeed ZeRO-2/3 on 2 gloo ranks, with its saves reloaded by peft.

``python -m tests.with_peft.peft_strategies_job OUT STRATEGY`` (under torchrun; STRATEGY: ddp, fsdp, zero2, zero3;
``+ -resume``: first stop at checkpoint-2 and resume from it; ``+ -hf``: the adapter added by transformers'
``add_adapter``): the Trainer's final save writes the adapter to OUT/run; rank 0 writes the gathered in-memory
adapter (OUT/adapter.safetensors), the logits of the trained, still sharded, model (OUT/logits.safetensors) and
``results.json`` (what the save holds); the test reloads the save with peft (:func:`reload_errors`)"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.helpers.jobs import StopAt, make_args
from tests.helpers.paths import CONFIGS
from tests.helpers.tiny import lm_dataset, tiny_llama
from tests.with_peft.lora_models import IDS, lora_config, lora_llama, max_diff
from trainer_ext import Trainer
from trainer_ext.checkpointing import sharded as sharded_checkpoint

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {},
    "fsdp": {"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}},
    "zero2": {"deepspeed": str(CONFIGS / "deepspeed" / "zero2.json")},
    "zero3": {"deepspeed": str(CONFIGS / "deepspeed" / "zero3.json")},
}


def hf_lora_llama() -> torch.nn.Module:
    """``tiny_llama(0)`` with the LoRA adapter added by transformers' ``add_adapter`` (stays a PreTrainedModel)."""
    model = tiny_llama(0)
    model.add_adapter(lora_config())
    return model


def lora_job(
    out: Path, per_device_batch: int, strategy: str = "ddp", resume: Path | None = None, **overrides: Any
) -> Trainer:
    """4 optimizer steps of a global batch of 4 samples, whatever the world size, then the final save to ``out``.

    ``strategy`` + ``-hf``: the adapter added through transformers instead of ``get_peft_model``."""
    hf = strategy.endswith("-hf")
    strategy = strategy.removesuffix("-hf")
    callbacks = [StopAt(overrides.pop("stop_at"))] if "stop_at" in overrides else []
    settings = dict(per_device_train_batch_size=per_device_batch, max_steps=4, save_final_model=True)
    trainer = Trainer(
        model=hf_lora_llama() if hf else lora_llama(0),
        args=make_args(out, **{**settings, **STRATEGIES[strategy], **overrides}),
        train_dataset=lm_dataset(16),
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    return trainer


def gathered(trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(adapter under peft's saved names, the rest of the model) gathered from the shards: a collective whose
    result is on the main process only (empty elsewhere)."""
    full = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if not full:
        return {}, {}
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    adapter = get_peft_model_state_dict(model, state_dict=full)
    frozen = {k: v.detach().float() for k, v in full.items() if "lora_" not in k}
    return {k: v.detach().float().contiguous() for k, v in adapter.items()}, frozen


@torch.no_grad()
def sharded_logits(trainer: Trainer) -> torch.Tensor:
    """Logits of the trained model as it stands after training (every rank runs the sharded forward)."""
    model = trainer.model_wrapped
    model.eval()
    return model(input_ids=IDS).logits.float().contiguous()


def fsdp_units(model: torch.nn.Module) -> list[list[Any]]:
    """Each FSDP2 unit: [module name, the requires_grad values of the parameters its state manages, how many]."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            params = [fp.sharded_param for fp in group.fsdp_params] if group is not None else []
            units.append([name, sorted({p.requires_grad for p in params}), len(params)])
    return units


def hf_reload_error(run: Path, expected: torch.Tensor) -> float:
    """Max |logits - expected| of a fresh base given the saved adapter by transformers' ``load_adapter``."""
    model = tiny_llama(0)
    model.load_adapter(str(run))
    with torch.no_grad():
        return float((model.eval()(input_ids=IDS).logits - expected).abs().max())


def reload_errors(run: Path, merged: Path, expected: torch.Tensor) -> dict[str, Any]:
    """Reload the saved adapter onto a fresh base, export it merged, reload that: max |logits - expected| of each.

    Run where no DeepSpeed config is registered (ZeRO-3 would partition ``from_pretrained`` on one rank only).
    """
    reloaded = PeftModel.from_pretrained(tiny_llama(0), str(run)).eval()
    with torch.no_grad():
        reload_error = float((reloaded(input_ids=IDS).logits - expected).abs().max())
    reloaded.merge_and_unload().save_pretrained(str(merged))
    plain = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    with torch.no_grad():
        merged_error = float((plain(input_ids=IDS).logits - expected).abs().max())
    return {"reload_logits": reload_error, "merged_logits": merged_error, "merged_type": type(plain).__name__}


def resume_job(out_dir: Path, strategy: str) -> None:
    """Stop after step 2 (checkpoint-2), resume to step 4: rank 0 writes the resumed adapter and the tensor names
    of the sharded checkpoint to OUT."""
    lora_job(out_dir / "stopped", 2, strategy, save_strategy="steps", save_steps=2, stop_at=2)
    checkpoint = out_dir / "stopped" / "checkpoint-2"
    trainer = lora_job(out_dir / "resumed", 2, strategy, resume=checkpoint)
    adapter, _ = gathered(trainer)
    if os.environ["RANK"] == "0":
        save_file(adapter, str(out_dir / "resumed.safetensors"))
        saved = sorted(sharded_checkpoint.saved_shapes(checkpoint)) if strategy == "fsdp" else []
        (out_dir / "checkpoint.json").write_text(json.dumps({"model_sharded": saved}, indent=1))
    trainer.accelerator.free_memory()


def main(out: str, strategy: str) -> None:
    out_dir = Path(out)
    if strategy.endswith("-resume"):
        strategy = strategy.removesuffix("-resume")
        resume_job(out_dir, strategy)
    per_device_batch = 4 // int(os.environ["WORLD_SIZE"])  # the global batch of 4 on 1 or 2 processes
    trainer = lora_job(out_dir / "run", per_device_batch=per_device_batch, strategy=strategy)
    adapter, frozen = gathered(trainer)
    logits = sharded_logits(trainer)
    if os.environ["RANK"] == "0":
        saved = load_file(str(out_dir / "run" / "adapter_model.safetensors"))
        if strategy.endswith("-hf"):  # transformers saves in PEFT's format: names under its wrapper's prefix
            saved = {k.removeprefix("base_model.model."): v for k, v in saved.items()}
        initial = {k: v for k, v in lora_llama(0).state_dict().items() if "lora_" not in k}
        if strategy.endswith("-hf"):
            initial = {k.removeprefix("base_model.model."): v for k, v in initial.items()}
        save_file(adapter, str(out_dir / "adapter.safetensors"))
        save_file({"logits": logits}, str(out_dir / "logits.safetensors"))
        result = {
            "wrapped": type(trainer.model_wrapped).__name__,
            "steps": trainer.state.global_step,
            "files": sorted(p.name for p in (out_dir / "run").iterdir()),
            "saved_keys": sorted(saved),
            "save_vs_memory": max_diff({k: v.float() for k, v in saved.items()}, adapter),
            "base_change": max_diff(frozen, initial),
            "fsdp_units": fsdp_units(trainer.model_wrapped),
        }
        (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    trainer.accelerator.free_memory()
    del trainer
    gc.collect()  # drop the DDP reducer / DeepSpeed engine before the group goes
    if torch.distributed.is_initialized():  # on one process DeepSpeed's own group may be gone already
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
