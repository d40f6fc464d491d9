"""Training jobs run on 1 rank in-process and on 2 ranks under torchrun, for parity checks.

``python -m tests.helpers.jobs OUT_DIR`` (under torchrun) runs every job and rank 0 writes weights and results to
OUT_DIR; the tests compare them with the same jobs run in the pytest process on one rank.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import TrainerCallback

from tests.helpers.device import use_cpu
from tests.helpers.tiny import lm_dataset, pad_right, ragged_lm_dataset, tiny_llama
from trainer_ext import Trainer, TrainingArguments


def make_args(out: Path | str, **overrides) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        num_train_epochs=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
        use_cpu=use_cpu(),  # TRAINER_EXT_TEST_DEVICE (tests/helpers/device.py): the CPU unless it says cuda
    )
    base.update(overrides)
    return TrainingArguments(**base)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


class StopAt(TrainerCallback):
    """Stop training right after global step ``step`` (a checkpoint is saved there by save_steps)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def parity_job(out: Path, per_device_batch: int, grad_accum: int = 1) -> dict[str, torch.Tensor]:
    """20 optimizer steps on 40 samples; same global batch whatever the world size."""
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(out, per_device_train_batch_size=per_device_batch, gradient_accumulation_steps=grad_accum),
        train_dataset=lm_dataset(40),
    )
    trainer.train()
    return weights(trainer)


def resume_jobs(out: Path, per_device_batch: int, grad_accum: int, stop: int) -> dict[str, dict]:
    """Uninterrupted run vs. a run stopped at ``stop`` (mid-epoch) then resumed from its checkpoint."""
    common = dict(
        per_device_train_batch_size=per_device_batch,
        gradient_accumulation_steps=grad_accum,
        save_strategy="steps",
        save_steps=stop,
    )
    data = lm_dataset(24, seed=3)
    full = Trainer(model=tiny_llama(0), args=make_args(out / "full", **common), train_dataset=data)
    full.train()
    part = Trainer(
        model=tiny_llama(0), args=make_args(out / "part", **common), train_dataset=data, callbacks=[StopAt(stop)]
    )
    part.train()
    interrupted_at = part.state.global_step
    resumed = Trainer(model=tiny_llama(0), args=make_args(out / "part", **common), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(out / "part" / f"checkpoint-{stop}"))
    return {
        "full": weights(full),
        "resumed": weights(resumed),
        "info": {
            "interrupted_at": interrupted_at,
            "steps_full": full.state.global_step,
            "steps_resumed": resumed.state.global_step,
            "max_steps": full.state.max_steps,
        },
    }


def eval_job(out: Path, n: int = 7) -> dict:
    """Evaluate and predict a dataset whose size is not divisible by the world size."""
    data = lm_dataset(n, seed=5)

    def metrics(pred):
        labels = np.asarray(pred.label_ids)
        return {"n_samples": int(labels.shape[0]), "label_sum": int(labels.sum())}

    trainer = Trainer(
        model=tiny_llama(1),
        args=make_args(out, per_device_eval_batch_size=2),
        eval_dataset=data,
        compute_metrics=metrics,
    )
    result = trainer.evaluate()
    predictions = trainer.predict(data).predictions
    return {"metrics": result, "predictions": np.asarray(predictions)}


class FirstStepGradients(TrainerCallback):
    """Keeps the gradients the first optimizer step sees: accumulated, all-reduced, not yet applied."""

    def __init__(self) -> None:
        self.gradients: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.gradients:
            self.gradients = {
                name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
            }


class ParityRun(NamedTuple):
    """Final weights, the first step's gradients and the logged figures of one parity run."""

    weights: dict[str, torch.Tensor]
    gradients: dict[str, torch.Tensor]
    info: dict


def accumulation_parity_job(out: Path, per_device_batch: int, grad_accum: int, bf16: bool = False) -> ParityRun:
    """Causal LM on variable-length, right-padded sequences: 12 optimizer steps of 8 samples each.

    The loss of a window is normalised by its target tokens over all micro-batches and ranks, so any
    world size x micro-batch x accumulation with the same global batch must give the same gradients.
    Plain SGD without clipping: a wrong constant factor on the gradients changes the weights too
    (AdamW and clipping would hide it).
    """
    gradients = FirstStepGradients()
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(
            out,
            per_device_train_batch_size=per_device_batch,
            gradient_accumulation_steps=grad_accum,
            bf16=bf16,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0.0,
        ),
        train_dataset=ragged_lm_dataset(48, seed=11),
        data_collator=pad_right,
        callbacks=[gradients],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    info = {
        "global_step": trainer.state.global_step,
        "scheduler_steps": trainer.lr_scheduler.last_epoch,
        "losses": [h["loss"] for h in logs],
        "grad_norms": [h["grad_norm"] for h in logs],
    }
    return ParityRun(weights(trainer), gradients.gradients, info)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float().to(a[k].device)).abs().max()) for k in a)


def assert_fp32_parity(run: ParityRun, reference: ParityRun, weights_tol: float = 1e-5) -> None:
    """The fp32 accumulation parity every split run must meet against the 1-rank big-batch reference.

    Both runs make 12 optimizer steps that move the weights and see non-trivial gradients (so a match is not
    vacuous); the first step's gradients agree to 1e-6, logged losses and grad norms to 1e-5, weights to
    ``weights_tol``.
    """
    assert reference.info["global_step"] == run.info["global_step"] == 12
    assert max_abs_diff(reference.weights, tiny_llama(0).state_dict()) > 1e-1, "the job must move the weights"
    assert max(float(g.abs().max()) for g in reference.gradients.values()) > 5e-2
    errors = parity_errors(run, reference)
    assert errors["gradients"] < 1e-6, errors
    assert errors["weights"] < weights_tol, errors
    assert errors["losses"] < 1e-5, errors
    assert errors["grad_norms"] < 1e-5, errors


def parity_errors(run: ParityRun, reference: ParityRun) -> dict[str, float]:
    """How far a split run is from the 1-rank big-batch reference: gradients, weights, logged losses and norms."""
    assert len(run.info["losses"]) == run.info["global_step"], "one logged loss per optimizer step"

    def logged(key: str) -> float:
        return max(abs(a - b) for a, b in zip(run.info[key], reference.info[key], strict=True))

    return {
        "gradients": max_abs_diff(run.gradients, reference.gradients),
        "weights": max_abs_diff(run.weights, reference.weights),
        "losses": logged("losses"),
        "grad_norms": logged("grad_norms"),
    }


class AllReduceCounter(TrainerCallback):
    """Counts DDP gradient all-reduces with a communication hook on the wrapped model."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.calls = trainer, 0

    def on_train_begin(self, args, state, control, **kwargs):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_hook(process_group, bucket):
            self.calls += 1
            return allreduce_hook(process_group, bucket)

        self.trainer.model_wrapped.register_comm_hook(None, counting_hook)


def allreduce_count_job(out: Path, grad_accum: int = 4) -> dict:
    """8 optimizer steps of 4 micro-batches: all-reduce only on the last micro-batch of each window."""
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(out, gradient_accumulation_steps=grad_accum, max_steps=8, ddp_bucket_cap_mb=512),
        train_dataset=lm_dataset(2 * 2 * grad_accum * 8),
    )
    counter = AllReduceCounter(trainer)
    trainer.add_callback(counter)
    trainer.train()
    return {
        "allreduce_calls": counter.calls,
        "optimizer_steps": trainer.state.global_step,
        "micro_batches": 8 * grad_accum,
    }


def compile_job(out: Path) -> dict:
    """torch.compile (eager backend) with an evaluation before training: DDP must still wrap the model."""
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(out, max_steps=3, torch_compile=True, torch_compile_backend="eager"),
        train_dataset=lm_dataset(16),
        eval_dataset=lm_dataset(4, seed=2),
    )
    trainer.evaluate()
    trainer.train()
    checksum = float(sum(p.double().sum() for p in trainer.model.parameters()))
    checksums: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(checksums, checksum)
    return {"wrapped": type(trainer.model_wrapped).__name__, "checksums": checksums}


def start_up_job(out: Path) -> dict:
    """One bf16 step of 2 ranks x batch 3 x accumulation 2: each rank's parallel mode and start-up block."""
    from trainer_ext.callbacks.run_summary import RunSummaryCallback

    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(
            out, per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=1, bf16=True, run_summary=True
        ),
        train_dataset=lm_dataset(24),
    )
    trainer.train()
    summary = trainer.callback_handler.duty(RunSummaryCallback)
    per_rank: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(
        per_rank, {"parallel_mode": str(trainer.args.parallel_mode), "printed": summary.printed}
    )
    return {"ranks": per_rank}


def reloaded_args_job(checkpoint: Path) -> list:
    """Every rank loads rank 0's training_args.bin: each must get its own rank back."""
    loaded = torch.load(checkpoint / "training_args.bin", weights_only=False)
    ranks: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, (loaded.process_index, loaded.world_size))
    return ranks


def main(out: str) -> None:
    out_dir = Path(out)
    rank = int(os.environ.get("RANK", "0"))
    parity = parity_job(out_dir / "parity", per_device_batch=2)
    resume = resume_jobs(out_dir / "resume", per_device_batch=2, grad_accum=1, stop=4)
    evaluation = eval_job(out_dir / "eval")
    ga_fp32 = accumulation_parity_job(out_dir / "ga_fp32", per_device_batch=2, grad_accum=2)
    ga_bf16 = accumulation_parity_job(out_dir / "ga_bf16", per_device_batch=2, grad_accum=2, bf16=True)
    allreduce = allreduce_count_job(out_dir / "allreduce")
    compiled = compile_job(out_dir / "compile")
    reloaded = reloaded_args_job(out_dir / "resume" / "part" / "checkpoint-4")
    start_up = start_up_job(out_dir / "start_up")
    if rank == 0:
        for name, run in (("ga_fp32", ga_fp32), ("ga_bf16", ga_bf16)):
            save_file(run.weights, str(out_dir / f"{name}.safetensors"))
            save_file(run.gradients, str(out_dir / f"{name}_gradients.safetensors"))
        save_file(parity, str(out_dir / "parity.safetensors"))
        save_file(resume["full"], str(out_dir / "resume_full.safetensors"))
        save_file(resume["resumed"], str(out_dir / "resume_resumed.safetensors"))
        np.save(out_dir / "predictions.npy", evaluation["predictions"])
        result = {
            "resume": resume["info"],
            "eval": evaluation["metrics"],
            "world_size": int(os.environ["WORLD_SIZE"]),
            "ga_fp32": ga_fp32.info,
            "ga_bf16": ga_bf16.info,
            "allreduce": allreduce,
            "compile": compiled,
            "reloaded_args": reloaded,
            "start_up": start_up,
        }
        (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    gc.collect()  # drop the DDP reducers before the group goes
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
