"""DeepSpeed ZeRO 0-3 (and offload) against plain DDP on the same data, on 2 gloo ranks under torchrun.

``python -m tests.distributed.strategies.ds_strategy_job OUT_DIR`` runs every job in sequence (one launch for the whole test module);
rank 0 writes the final weights as safetensors and the measurements to ``results.json``.

Each run: 6 optimizer steps of 2 ranks x micro-batch 2 x accumulation 2, AdamW, a linear LR decay and
gradient clipping at 1.0 (active: the norms are above 1), in fp32 on CPU.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

from tests.helpers.paths import CONFIGS
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext.distributed import DistState
from trainer_ext.distributed.strategies.deepspeed.config import (
    DeepSpeedInputs,
    finalize,
    load_deepspeed_config,
    model_hidden_size,
    resolve_auto,
)
from trainer_ext.distributed.strategies.deepspeed.strategy import DeepSpeedStrategy, check_complete

PRESETS = CONFIGS / "deepspeed"
STEPS, MICRO, ACCUM, WORLD = 6, 2, 2, 2
LR, CLIP, DECAY, WARMUP = 1e-2, 1.0, 0.01, 2
RUNS = ("zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
# zero2 plus optimizer and scheduler blocks in the JSON ("auto" parameters): DeepSpeed builds both
CONFIG_BLOCKS_RUN = "zero2_config_blocks"
BLOCKS = {
    "optimizer": {
        "type": "AdamW",
        # torch's AdamW: DeepSpeed's FusedAdam is a compiled op not built on CPU
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
            "warmup_type": "linear",
        },
    },
}
INPUTS = DeepSpeedInputs(
    world_size=WORLD,
    micro_batch_size=MICRO,
    gradient_accumulation_steps=ACCUM,
    max_grad_norm=CLIP,
    learning_rate=LR,
    weight_decay=DECAY,
)
IDS = torch.tensor(lm_dataset(STEPS * WORLD * MICRO * ACCUM, seed=7)["input_ids"])


def micro_batch(step: int, micro: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``micro``-th micro-batch of optimizer step ``step``: each sample used once."""
    start = ((step * ACCUM + micro) * WORLD + rank) * MICRO
    return IDS[start : start + MICRO]


def linear_decay(step: int) -> float:
    return 1.0 - step / STEPS


def warmup_decay(step: int) -> float:
    """DeepSpeed's WarmupDecayLR (linear warm-up) as a LambdaLR factor.

    DeepSpeed's schedule starts one step late: it sits at warmup_min_lr for the first two steps.
    """
    step -= 1
    if step < 0:
        return 0.0
    return step / WARMUP if step < WARMUP else max(0.0, (STEPS - step) / (STEPS - WARMUP))


def optimizer_and_scheduler(
    model: torch.nn.Module, schedule=linear_decay
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def ddp_run(schedule=linear_decay) -> tuple[dict[str, torch.Tensor], dict]:
    """The reference: torch DDP on gloo, no_sync on non-final micro-batches, torch clipping."""
    model = DistributedDataParallel(tiny_llama(0))
    optimizer, scheduler = optimizer_and_scheduler(model, schedule)
    rank, losses, norms = dist.get_rank(), [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACCUM):
            ids = micro_batch(step, micro, rank)
            sync = micro == ACCUM - 1
            with model.no_sync() if not sync else torch.enable_grad():
                loss = model(input_ids=ids, labels=ids).loss
                (loss / ACCUM).backward()
            total += float(loss) / ACCUM
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(global_mean(total))
    weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return weights, {"losses": losses, "grad_norms": norms, "lr_after": scheduler.get_last_lr()[0]}


def ds_config(preset: str) -> dict:
    """A preset resolved the way the Trainer does it: TrainingArguments values, then the model's and schedule's."""
    if preset == CONFIG_BLOCKS_RUN:
        config = {**load_deepspeed_config(PRESETS / "zero2.json"), **BLOCKS}
    else:
        config = load_deepspeed_config(PRESETS / f"{preset}.json")
    config = resolve_auto(config, INPUTS)
    return finalize(config, model_hidden_size(tiny_llama(0)), num_training_steps=STEPS, num_warmup_steps=WARMUP)


def train_steps(strategy: DeepSpeedStrategy, engine, steps: range) -> tuple[list[float], list[float]]:
    rank, losses, norms = dist.get_rank(), [], []
    for step in steps:
        total = 0.0
        for micro in range(ACCUM):
            ids = micro_batch(step, micro, rank)
            loss = engine(input_ids=ids, labels=ids).loss
            strategy.backward(loss / ACCUM)
            strategy.step()
            total += float(loss) / ACCUM
        norms.append(float(strategy.clip_grad_norm_(engine.parameters(), CLIP)))
        losses.append(global_mean(total))
    return losses, norms


def held_bytes(engine) -> int:
    """Bytes of parameters and optimizer state this rank holds (each storage once).

    Module parameters (under ZeRO-3 their ``ds_tensor`` partitions), the optimizer's parameters (ZeRO's
    fp32 master partitions) and its state (Adam moments); gradients are not counted.
    """
    tensors = []
    for p in engine.module.parameters():
        tensors.append(p.data)
        if hasattr(p, "ds_tensor"):
            tensors.append(p.ds_tensor)
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for group in base.param_groups:
        tensors += list(group["params"])
    for state in base.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def ds_run(state: DistState, preset: str, out: Path) -> dict:
    """Train the whole run; under the stages with a resume check, also stop at 3, save, reload, continue."""
    strategy = DeepSpeedStrategy(state, ds_config(preset))
    model = tiny_llama(0)
    if preset == CONFIG_BLOCKS_RUN:
        engine, _, scheduler = strategy.initialize(model)
    else:
        engine, _, scheduler = strategy.initialize(model, *optimizer_and_scheduler(model))
    losses, norms = train_steps(strategy, engine, range(STEPS))
    memory = held_bytes(engine)  # after training: Adam allocates its moments at the first step
    partitioned = [p for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
    result = {
        "losses": losses,
        "grad_norms": norms,
        "held_bytes": memory,
        "lr_after": scheduler.get_last_lr()[0],
        "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
        "scheduler": type(scheduler).__name__,
        "partitioned": sum(p.ds_tensor.numel() < p.ds_numel for p in partitioned),
        "raw_state_dict_numel": sum(v.numel() for v in engine.module.state_dict().values()),
    }
    full = strategy.consolidated_state_dict(engine)
    if state.is_main_process:
        result["consolidated_keys"] = len(full)
        result["consolidated_numel"] = sum(v.numel() for v in full.values())
        result["model_numel"] = sum(p.numel() for p in tiny_llama(0).parameters())
        save_file(full, str(out / f"{preset}.safetensors"))
        if preset == "zero3":
            engine.module.save_pretrained(out / "zero3_export", state_dict=full, safe_serialization=True)
            try:  # what a plain module.state_dict() save would hold under ZeRO-3
                check_complete(engine.module, engine.module.state_dict())
                result["raw_state_dict_refused"] = False
            except RuntimeError as exc:
                result["raw_state_dict_refused"] = str(exc)
    strategy.forget()
    del engine, full
    gc.collect()
    return result


def resume_run(state: DistState, preset: str, out: Path) -> dict:
    """3 steps, save_checkpoint, a fresh engine from other initial weights, load_checkpoint, 3 more steps."""
    ckpt = out / f"ckpt_{preset}"
    first = DeepSpeedStrategy(state, ds_config(preset))
    model = tiny_llama(0)
    engine, _, _ = first.initialize(model, *optimizer_and_scheduler(model))
    head, _ = train_steps(first, engine, range(STEPS // 2))
    first.save_checkpoint(engine, ckpt, client_state={"step": STEPS // 2})
    first.forget()
    del engine
    gc.collect()

    second = DeepSpeedStrategy(state, ds_config(preset))
    model = tiny_llama(123)  # different weights: only the checkpoint can make the runs agree
    engine, _, scheduler = second.initialize(model, *optimizer_and_scheduler(model))
    client = second.load_checkpoint(engine, ckpt)
    tail, _ = train_steps(second, engine, range(client["step"], STEPS))
    full = second.consolidated_state_dict(engine)
    if state.is_main_process:
        save_file(full, str(out / f"{preset}_resumed.safetensors"))
    result = {"losses": head + tail, "client_step": client["step"], "lr_after": scheduler.get_last_lr()[0]}
    second.forget()
    del engine, full
    gc.collect()
    return result


def from_pretrained_check(state: DistState, out: Path) -> dict:
    """Registered with transformers, a ZeRO-3 config makes from_pretrained build the model partitioned."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    path = out / "pretrained"
    if state.is_main_process:
        tiny_llama(0).save_pretrained(path)
    state.wait_for_everyone()
    strategy = DeepSpeedStrategy(state, ds_config("zero3"))
    before = is_deepspeed_zero3_enabled()
    strategy.register_with_transformers()
    during = is_deepspeed_zero3_enabled()
    model = AutoModelForCausalLM.from_pretrained(path)
    strategy.unregister_from_transformers()
    after = is_deepspeed_zero3_enabled()
    params = list(model.parameters())
    partitioned = sum(hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel for p in params)
    import deepspeed

    reference = tiny_llama(0).state_dict()
    with deepspeed.zero.GatheredParameters(params):
        error = max(float((v - reference[k]).abs().max()) for k, v in model.state_dict().items())
    with strategy.zero3_init_context():
        layer = torch.nn.Linear(32, 64)
    return {
        "init_context_partitioned": layer.weight.ds_tensor.numel() < layer.weight.ds_numel == 64 * 32,
        "enabled": [before, during, after],
        "partitioned": partitioned,
        "params": len(params),
        "max_abs_error": error,
    }


def main(out: str) -> None:
    out_dir = Path(out)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    state = DistState(cpu=True)
    ddp_weights, ddp = ddp_run()
    warm_weights, ddp_warm = ddp_run(warmup_decay)
    results: dict = {"ddp": ddp, "ddp_warmup_decay": ddp_warm, "world_size": state.num_processes}
    gc.collect()  # drop the DDP reducers before DeepSpeed uses the group
    for preset in (*RUNS, CONFIG_BLOCKS_RUN):
        results[preset] = ds_run(state, preset, out_dir)
    for preset in ("zero2", "zero3"):
        results[f"{preset}_resume"] = resume_run(state, preset, out_dir)
    results["from_pretrained"] = from_pretrained_check(state, out_dir)
    if state.is_main_process:
        save_file(ddp_weights, str(out_dir / "ddp.safetensors"))
        save_file(warm_weights, str(out_dir / "ddp_warmup_decay.safetensors"))
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    all_results: list = [None] * state.num_processes
    dist.all_gather_object(all_results, {k: v.get("held_bytes") for k, v in results.items() if isinstance(v, dict)})
    if state.is_main_process:
        (out_dir / "held_bytes.json").write_text(json.dumps(all_results, indent=1))
    state.destroy()


def single_process_main(out: str) -> None:
    """One process without a launcher: the strategy makes its own one-rank group and hands DeepSpeed LOCAL_RANK."""
    state = DistState(cpu=True)
    assert not dist.is_initialized() and "LOCAL_RANK" not in os.environ
    config = finalize(resolve_auto(load_deepspeed_config(PRESETS / "zero3.json"), DeepSpeedInputs()), 32)
    strategy = DeepSpeedStrategy(state, config)
    model = tiny_llama(0)
    engine, _, _ = strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR))
    ids = IDS[:2]
    losses = []
    for _ in range(3):
        loss = engine(input_ids=ids, labels=ids).loss
        strategy.backward(loss)
        strategy.step()
        losses.append(float(loss))
    full = strategy.consolidated_state_dict(engine)
    result = {
        "world_size": engine.world_size,
        "losses": losses,
        "grad_norm": float(strategy.clip_grad_norm_(engine.parameters(), 1.0)),
        "keys": len(full),
        "local_rank_env": os.environ.get("LOCAL_RANK"),
    }
    strategy.forget()
    del engine
    evaluator = DeepSpeedStrategy(state, config)  # wrap: an engine without optimizer, for evaluation
    wrapped = evaluator.wrap(tiny_llama(0))
    with torch.no_grad():
        logits = wrapped(input_ids=ids).logits
        expected = tiny_llama(0)(input_ids=ids).logits
    result["wrap_unwraps_to"] = type(evaluator.unwrap(wrapped)).__name__
    result["wrap_logits_error"] = float((logits - expected).abs().max())
    evaluator.forget()
    strategy.destroy()
    result["group_after_destroy"] = dist.is_initialized()
    Path(out, "single.json").write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if sys.argv[1] == "--single":
        single_process_main(sys.argv[2])
    else:
        main(sys.argv[1])
