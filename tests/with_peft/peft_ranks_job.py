"""A LoRA training job run on 1 rank in-process and on 2 ranks under torchrun, for the DDP parity test.

``python -m tests.with_peft.peft_ranks_job OUT_DIR`` (under torchrun): rank 0 writes the trained adapter and results to OUT_DIR; the
Trainer's final save (UnwrapAndSaveCallback) writes the adapter to OUT_DIR/run.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.helpers.jobs import make_args
from tests.helpers.tiny import lm_dataset
from tests.with_peft.lora_models import adapter_state, base_state, lora_llama, max_diff
from trainer_ext import Trainer


def lora_parity_job(out: Path, per_device_batch: int) -> Trainer:
    """8 optimizer steps of a global batch of 4 samples, whatever the world size."""
    trainer = Trainer(
        model=lora_llama(0),
        args=make_args(out, per_device_train_batch_size=per_device_batch, max_steps=8, save_final_model=True),
        train_dataset=lm_dataset(32),
    )
    trainer.train()
    return trainer


def main(out: str) -> None:
    out_dir = Path(out)
    trainer = lora_parity_job(out_dir / "run", per_device_batch=2)
    adapter = adapter_state(trainer.model)
    checksum = float(sum(v.double().sum() for v in adapter.values()))
    checksums: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(checksums, checksum)
    if torch.distributed.get_rank() == 0:
        save_file(adapter, str(out_dir / "adapter.safetensors"))
        result = {
            "wrapped": type(trainer.model_wrapped).__name__,
            "checksums": checksums,
            "base_change": max_diff(base_state(trainer.model), base_state(lora_llama(0))),
            "steps": trainer.state.global_step,
        }
        (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    del trainer
    gc.collect()  # drop the DDP reducer before the group goes
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
