"""Hand-written accelerate-style loops on trainer_ext.Accelerator, run on 1 rank in-process and on 2 ranks.

``python loops.py OUT_DIR`` (under torchrun) runs every loop; rank 0 writes weights and results.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import default_data_collator, get_linear_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiny import lm_dataset, tiny_llama  # noqa: E402

from trainer_ext import Accelerator  # noqa: E402


def weights(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full weights (gathered on rank 0 for a sharded model)."""
    inner = accelerator.unwrap_model(model)
    sharded = accelerator.distributed_type in ("FSDP", "DEEPSPEED")
    state = accelerator.get_state_dict(model) if sharded else inner.state_dict()
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


MODEL_FIRST = ("model", "optimizer", "loader", "scheduler")


def build(
    accelerator: Accelerator,
    per_device_batch: int,
    n: int = 40,
    epochs: int = 2,
    lr: float = 1e-2,
    order: tuple[str, ...] = MODEL_FIRST,
):
    """Model, optimizer, loader and scheduler, given to one ``prepare`` call in ``order``; returned model first."""
    model = tiny_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(
        lm_dataset(n).with_format("torch"), batch_size=per_device_batch, shuffle=True, collate_fn=default_data_collator
    )
    steps = epochs * -(-n // (per_device_batch * accelerator.num_processes * accelerator.gradient_accumulation_steps))
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, steps)
    objects = {"model": model, "optimizer": optimizer, "loader": loader, "scheduler": scheduler}
    prepared = dict(zip(order, accelerator.prepare(*(objects[name] for name in order)), strict=True))
    return tuple(prepared[name] for name in MODEL_FIRST)


def train_loop(
    per_device_batch: int,
    grad_accum: int = 1,
    epochs: int = 2,
    stop_after: int | None = None,
    save_to: Path | None = None,
    resume_from: Path | None = None,
    fsdp_config: dict | None = None,
    deepspeed_config: str | None = None,
    order: tuple[str, ...] = MODEL_FIRST,
) -> tuple[Accelerator, dict[str, torch.Tensor], dict]:
    """The accelerate-example loop: accumulate, backward, clip, step, schedule, zero_grad."""
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=grad_accum,
        seed=0,
        fsdp_config=fsdp_config,
        deepspeed_config=deepspeed_config,
    )
    model, optimizer, loader, scheduler = build(accelerator, per_device_batch, epochs=epochs, order=order)
    start_epoch, seen = 0, 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        start_epoch = loader.state_dict()["epoch"]
    model.train()
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)  # a resumed loader keeps its pending skip: it continues mid-epoch
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            seen += 1
            if stop_after is not None and seen == stop_after:
                accelerator.save_state(save_to)
                return accelerator, weights(accelerator, model), {"lr": scheduler.get_last_lr()[0]}
    info = {"lr": scheduler.get_last_lr()[0], "scheduler_steps": scheduler.scheduler.last_epoch}
    return accelerator, weights(accelerator, model), info


def main(out: str) -> None:
    out_dir = Path(out)
    rank = int(os.environ.get("RANK", "0"))
    _, parity, parity_info = train_loop(per_device_batch=2)
    _, accum, accum_info = train_loop(per_device_batch=1, grad_accum=2)
    _, full, _ = train_loop(per_device_batch=2)
    train_loop(per_device_batch=2, stop_after=3, save_to=out_dir / "state")
    accelerator, resumed, _ = train_loop(per_device_batch=2, resume_from=out_dir / "state")
    tracked = Accelerator(cpu=True, log_with="tensorboard", project_dir=out_dir / "tracking")
    tracked.init_trackers("loops", config={"ranks": tracked.num_processes})
    tracked.log({"rank_loss": float(tracked.process_index)}, step=1)
    for tracker in tracked.trackers:
        tracker.finish()
    gathered = accelerator.gather_for_metrics(torch.arange(3) + 10 * accelerator.process_index)
    main_only = accelerator.on_main_process(lambda: accelerator.process_index)()
    rank = accelerator.process_index
    members = {
        "reduce_sum": accelerator.reduce(torch.tensor([rank + 1.0])).tolist(),
        "reduce_mean": accelerator.reduce(torch.tensor([rank + 1.0]), "mean").tolist(),
        "gather": accelerator.gather(torch.tensor([rank])).tolist(),
        "padded": accelerator.pad_across_processes(torch.ones(rank + 1), dim=0, pad_index=-1).tolist(),
        "distributed_type": str(accelerator.distributed_type.value),
        "num_processes": accelerator.num_processes,
    }
    order_file = out_dir / "order.txt"
    with accelerator.main_process_first():
        with open(order_file, "a") as handle:
            handle.write(f"{rank}\n")
    accelerator.wait_for_everyone()
    members["order"] = order_file.read_text().split()
    model = tiny_llama(3)
    accelerator.save_model(model, out_dir / "saved")
    members["saved_files"] = sorted(p.name for p in (out_dir / "saved").iterdir())
    accelerator.print(f"printed by rank {rank}")
    if rank == 0:
        save_file(parity, str(out_dir / "parity.safetensors"))
        save_file(accum, str(out_dir / "accum.safetensors"))
        save_file(full, str(out_dir / "full.safetensors"))
        save_file(resumed, str(out_dir / "resumed.safetensors"))
        (out_dir / "results.json").write_text(
            json.dumps(
                {
                    "parity": parity_info,
                    "accum": accum_info,
                    "gathered": gathered.tolist(),
                    "main_only": main_only,
                    "members": members,
                }
            )
        )
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
