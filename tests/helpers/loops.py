"""Hand-written accelerate-style loops on trainer_ext.Accelerator, run on 1 rank in-process and on 2 ranks.

``python -m tests.helpers.loops OUT_DIR`` (under torchrun) runs every loop; rank 0 writes weights and results.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import default_data_collator, get_linear_schedule_with_warmup

from tests.helpers.device import use_cpu
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Accelerator, DataLoaderConfiguration
from trainer_ext.distributed import collectives


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
    # accelerate's examples: the schedule is sized from the unsharded loader, and a prepared scheduler advances
    # num_processes steps per optimizer step, so it ends on time on any number of processes
    steps = epochs * -(-len(loader) // accelerator.gradient_accumulation_steps)
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
    fsdp_plugin: Any = None,
    deepspeed_config: str | None = None,
    order: tuple[str, ...] = MODEL_FIRST,
) -> tuple[Accelerator, dict[str, torch.Tensor], dict]:
    """The accelerate-example loop: accumulate, backward, clip, step, schedule, zero_grad."""
    accelerator = Accelerator(
        cpu=use_cpu(),
        gradient_accumulation_steps=grad_accum,
        # the same order on any number of processes (accelerate's default reshuffles from the global RNG)
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        seed=0,
        fsdp_config=fsdp_config,
        fsdp_plugin=fsdp_plugin,
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


def per_rank(value: object) -> list:
    """``value`` of every rank, in rank order."""
    values: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def grad_checksum(model: torch.nn.Module) -> float:
    return float(sum(p.grad.double().sum() for p in model.parameters() if p.grad is not None))


def allreduce_counts() -> dict:
    """DDP gradient all-reduces (counted by a comm hook) under ``no_sync`` and over ``accumulate`` windows."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = accelerator.prepare(tiny_llama(0))
    calls = [0]

    def counting_hook(process_group, bucket):
        calls[0] += 1
        return allreduce_hook(process_group, bucket)

    model.register_comm_hook(None, counting_hook)
    ids = torch.tensor([[5, 6, 7, 8, 9]]) + accelerator.process_index  # each rank its own data

    def backward() -> None:
        accelerator.backward(model(input_ids=ids, labels=ids).loss)

    backward()
    result = {"per_sync": calls[0]}
    model.zero_grad()
    for _ in range(3):
        with accelerator.no_sync(model):
            backward()
    result["no_sync"] = calls[0] - result["per_sync"]
    result["no_sync_grads"] = per_rank(grad_checksum(model))  # local: each rank's own
    backward()
    result["then_sync"] = calls[0] - result["per_sync"]
    result["synced_grads"] = per_rank(grad_checksum(model))  # all-reduced: the same on every rank
    model.zero_grad()
    calls[0] = 0
    for _ in range(8):
        with accelerator.accumulate(model):
            backward()
    result["accumulate_8_of_4"] = calls[0]
    return result


def autocast_and_unwrap() -> dict:
    """bf16 ``autocast()``, and ``unwrap_model(keep_fp32_wrapper=False)`` giving back the plain fp32 forward."""
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(tiny_llama(0))
    with accelerator.autocast():
        inside = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        wrapped = model(input_ids=ids).logits
        plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
        unwrapped = plain(input_ids=ids).logits
        reference = tiny_llama(0)(input_ids=ids).logits
    return {
        "autocast_dtype": str(inside),
        "prepared": type(model).__name__,
        "unwrapped": type(plain).__name__,
        "wrapped_dtype": str(wrapped.dtype),
        "wrapped_differs": float((wrapped - reference).abs().max()),
        "unwrapped_equal": bool(torch.equal(unwrapped, reference)),
    }


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
    tracker = tracked.get_tracker("tensorboard")  # on rank 1 a blank one: the same call is safe everywhere
    tracker.log({"through_get_tracker": float(tracked.process_index)}, step=1)
    tracker_types = per_rank(type(tracker).__name__)
    for tracker in tracked.trackers:
        tracker.finish()
    gathered = accelerator.gather_for_metrics(torch.arange(3) + 10 * accelerator.process_index)
    main_only = accelerator.on_main_process(lambda: accelerator.process_index)()
    rank = accelerator.process_index
    members = {
        "reduce_sum": accelerator.reduce(torch.tensor([rank + 1.0])).tolist(),
        "reduce_mean": accelerator.reduce(torch.tensor([rank + 1.0]), "mean").tolist(),
        "gather": accelerator.gather(torch.tensor([rank])).tolist(),
        # the form NCCL takes (one output tensor) against gloo's (a list, concatenated), on the same real group
        "gather_forms": [
            [collectives._gather_tensor(t, into_one=form).tolist() for form in (False, True)]
            for t in (torch.tensor(rank), torch.arange(3) + 10 * rank, torch.full((2, 3), rank + 0.5))
        ],
        "padded": accelerator.pad_across_processes(torch.ones(rank + 1), dim=0, pad_index=-1).tolist(),
        "distributed_type": str(accelerator.distributed_type.value),
        "num_processes": accelerator.num_processes,
        "where": per_rank(
            [str(accelerator.device), accelerator.is_local_main_process, accelerator.local_process_index]
        ),
        "tracker_types": tracker_types,
    }
    accelerator.save({"rank": torch.tensor(rank)}, out_dir / "save.pt")  # every rank calls, the main one writes
    accelerator.save({"rank": torch.tensor(rank)}, out_dir / f"save_by_{rank}.pt")
    accelerator.wait_for_everyone()
    members["save"] = {
        "rank_in_file": int(torch.load(out_dir / "save.pt", weights_only=True)["rank"]),
        "files": sorted(p.name for p in out_dir.glob("save_by_*.pt")),
    }
    members["allreduce"] = allreduce_counts()
    members["autocast"] = autocast_and_unwrap()
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
