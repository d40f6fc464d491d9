"""Parity scenarios about what runs leave behind and how they fail: checkpoints, resume, files, arguments, errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import set_seed

from tests.helpers.ranks import child_env
from tests.parity_harness.workload import files_under

from .observe import error, jsonable, metrics, stage
from .registry import SCENARIOS, Impl, scenario
from .script import Script, train
from .workload import (
    CrashAt,
    RegressionModel,
    RegressionStream,
    pickled_class,
    regression_dataset,
    tiny_llama,
    token_dataset,
    trainer_state,
    training_args,
)


def resumable_run(impl: Impl, workdir: Path, output_dir: Path, resume: bool | str, crash_at: int | None) -> Script:
    """max_steps=12 over 6-step epochs, a checkpoint every 4 steps; optionally crashing or resuming."""
    set_seed(0)
    model = RegressionModel()
    args = training_args(
        impl,
        workdir,
        output_dir=str(output_dir),
        max_steps=12,
        save_steps=4,
        per_device_train_batch_size=4,
        warmup_steps=2,
    )
    script = Script(impl, workdir, model, args, regression_dataset(24), tap=True, record=False)
    if crash_at is not None:
        script.trainer.add_callback(CrashAt(crash_at))
    script.play(train(resume_from_checkpoint=resume or None))
    return script


def step_logs(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-step log entries (the final summary's train_loss only covers a resumed run's own steps)."""
    return [entry for entry in run["log_history"] if "train_loss" not in entry]


def resume_and_check(
    impl: Impl, workdir: Path, output_dir: Path, result: dict[str, Any], resume: bool | str = True
) -> dict[str, Any]:
    """Resume in ``output_dir``, run the same job uninterrupted, and say whether resuming reproduced it."""
    full = resumable_run(impl, workdir, workdir / "uninterrupted", False, None)
    result["uninterrupted"] = full.finish()
    del result["uninterrupted"]["files"]  # all files are listed once, at the end
    resumed = resumable_run(impl, workdir, output_dir, resume, None)
    result["resumed"] = resumed.finish()
    del result["resumed"]["files"]
    result["files"] = files_under(workdir)
    result["resumed_equals_uninterrupted"] = {
        "weights_bitwise": result["resumed"]["weights"]["sha256"] == result["uninterrupted"]["weights"]["sha256"],
        "step_logs": step_logs(result["resumed"]) == step_logs(result["uninterrupted"]),
        "batches_after_checkpoint": resumed.tap.train == full.tap.train[8:],
    }
    return result


@scenario
def resume_after_interruption(impl: Impl, workdir: Path) -> dict[str, Any]:
    """Crashed at step 9, resumed with resume_from_checkpoint=True (checkpoint-8) vs the uninterrupted run."""
    crashed = resumable_run(impl, workdir, workdir / "interrupted", False, 9)
    interrupted = crashed.result
    interrupted["global_step"] = crashed.trainer.state.global_step
    interrupted["batches"] = crashed.tap.summary()
    interrupted["files_after_crash"] = files_under(workdir / "interrupted")
    return resume_and_check(impl, workdir, workdir / "interrupted", {"interrupted": interrupted})


def crashed_run(impl: Impl, workdir: Path) -> dict[str, Any]:
    """The first half of resume_across_implementations (run by the other implementation): crash at step 9."""
    crashed = resumable_run(impl, workdir, workdir / "interrupted", False, 9)
    return {**crashed.result, "global_step": crashed.trainer.state.global_step}


SCENARIOS["_crashed_run"] = crashed_run  # a helper process, not a scenario of its own


def crashed_by_the_other(impl: Impl, workdir: Path) -> dict[str, Any]:
    """Run the crashing first half under the other implementation, in its own process, in ``workdir``."""
    other = "ours" if impl.name == "stock" else "stock"
    command = [sys.executable, "-m", "tests.parity.run_scenario", "--impl", other]
    command += ["--scenario", "_crashed_run", "--workdir", str(workdir), "--out", str(workdir / "first_half.json")]
    process = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    if process.returncode != 0:
        raise RuntimeError(f"the other implementation's run failed:\n{process.stderr[-3000:]}")
    first_half = json.loads((workdir / "first_half.json").read_text())
    (workdir / "first_half.json").unlink()
    interrupted = first_half.get("result", first_half)
    interrupted["files_after_crash"] = files_under(workdir / "interrupted")
    return interrupted


@scenario
def resume_across_implementations(impl: Impl, workdir: Path) -> dict[str, Any]:
    """resume_from_checkpoint=True on the other implementation's checkpoints (stock resumes ours, ours stock's)."""
    interrupted = crashed_by_the_other(impl, workdir)
    return resume_and_check(impl, workdir, workdir / "interrupted", {"interrupted_by_the_other": interrupted})


@scenario
def resume_across_implementations_by_path(impl: Impl, workdir: Path) -> dict[str, Any]:
    """resume_from_checkpoint=".../checkpoint-8" written by the other implementation."""
    interrupted = crashed_by_the_other(impl, workdir)
    checkpoint = str(workdir / "interrupted" / "checkpoint-8")
    return resume_and_check(
        impl, workdir, workdir / "interrupted", {"interrupted_by_the_other": interrupted}, checkpoint
    )


def resume_from_nothing(impl: Impl, workdir: Path, checkpoint: bool | str) -> dict[str, Any]:
    """A fresh output_dir and train(resume_from_checkpoint=checkpoint) where there is nothing to resume."""
    set_seed(0)
    args = training_args(impl, workdir)
    script = Script(impl, workdir, RegressionModel(), args, regression_dataset(16), record=False)
    return script.run(train(resume_from_checkpoint=checkpoint))


@scenario
def resume_true_without_checkpoint(impl: Impl, workdir: Path) -> dict[str, Any]:
    """train(resume_from_checkpoint=True) with no checkpoint in output_dir: the exception."""
    return resume_from_nothing(impl, workdir, True)


@scenario
def resume_nonexistent_path(impl: Impl, workdir: Path) -> dict[str, Any]:
    """train(resume_from_checkpoint="/nonexistent"): the exception."""
    return resume_from_nothing(impl, workdir, "/nonexistent")


@scenario
def files_without_save_model(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A Llama trained with a checkpoint every epoch and save_model never called: the files left on disk."""
    set_seed(0)
    args = training_args(
        impl, workdir, save_strategy="epoch", per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=2
    )
    result = Script(impl, workdir, tiny_llama(), args, token_dataset(12)).run(train())
    by_folder: dict[str, list[str]] = {}
    for name in result["files"]:
        folder, _, rest = name.rpartition("/")
        by_folder.setdefault(folder or ".", []).append(rest)
    result["files_by_folder"] = by_folder
    for checkpoint in sorted((workdir / "out").glob("checkpoint-*")):
        result[f"{checkpoint.name}_trainer_state"] = trainer_state(checkpoint / "trainer_state.json")
        result[f"{checkpoint.name}_training_args_bin"] = pickled_class(checkpoint / "training_args.bin")
    return result


@scenario
def save_only_model(impl: Impl, workdir: Path) -> dict[str, Any]:
    """save_only_model=True with a checkpoint every epoch: the files of each checkpoint."""
    set_seed(0)
    args = training_args(impl, workdir, save_only_model=True, save_strategy="epoch", save_total_limit=1)
    return Script(impl, workdir, RegressionModel(), args, regression_dataset(24)).run(train())


@scenario
def example_script_tail(impl: Impl, workdir: Path) -> dict[str, Any]:
    """The end of transformers' example scripts: save_model, log_metrics, save_metrics, save_state, evaluate."""
    set_seed(0)
    args = training_args(
        impl, workdir, per_device_train_batch_size=4, learning_rate=1e-3, save_strategy="no", num_train_epochs=1
    )
    script = Script(impl, workdir, tiny_llama(), args, token_dataset(12), token_dataset(6, first_id=30))
    trainer = script.trainer
    train_result = trainer.train()
    trainer.save_model()
    train_metrics = train_result.metrics
    train_metrics["train_samples"] = 12
    trainer.log_metrics("train", train_metrics)
    trainer.save_metrics("train", train_metrics)
    trainer.save_state()
    eval_metrics = trainer.evaluate()
    eval_metrics["perplexity"] = math.exp(eval_metrics["eval_loss"])
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("eval", eval_metrics)
    out = workdir / "out"
    script.result |= {
        "all_results": metrics(json.loads((out / "all_results.json").read_text())),
        "trainer_state": trainer_state(out / "trainer_state.json"),
        "config": {
            k: v for k, v in json.loads((out / "config.json").read_text()).items() if k != "transformers_version"
        },
        "training_args_bin": pickled_class(out / "training_args.bin"),
    }
    return script.finish()


@scenario
def default_trainer_args(impl: Impl, workdir: Path) -> dict[str, Any]:
    """Trainer(model, train_dataset=...) with no TrainingArguments, run from the working directory."""
    os.chdir(workdir)
    set_seed(0)
    script = Script(impl, workdir, RegressionModel(), train_dataset=regression_dataset(24))
    trainer_args = script.trainer.args
    script.result |= {
        "output_dir": trainer_args.output_dir,
        "args_type": type(trainer_args).__name__,
        "learning_rate": trainer_args.learning_rate,
    }
    return script.run(train())


@scenario
def arguments_surface(impl: Impl, workdir: Path) -> dict[str, Any]:
    """What scripts read from TrainingArguments and trainer.accelerator before and after building the Trainer."""
    args = training_args(impl, workdir, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    result: dict[str, Any] = {
        "to_dict_keys": sorted(args.to_dict()),
        "device": str(args.device),
        "n_gpu": args.n_gpu,
        "world_size": args.world_size,
        "process_index": args.process_index,
        "local_process_index": args.local_process_index,
        "parallel_mode": str(args.parallel_mode),
        "train_batch_size": args.train_batch_size,
        "eval_batch_size": args.eval_batch_size,
        "should_log": args.should_log,
        "should_save": args.should_save,
        "place_model_on_device": args.place_model_on_device,
    }
    set_seed(0)
    model = RegressionModel()
    trainer = impl.Trainer(model=model, args=args, train_dataset=regression_dataset(8))
    accelerator = trainer.accelerator
    result["accelerator"] = {
        "is_main_process": accelerator.is_main_process,
        "is_local_main_process": accelerator.is_local_main_process,
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "device": str(accelerator.device),
        "mixed_precision": str(accelerator.mixed_precision),
        "unwrap_model_is_model": accelerator.unwrap_model(trainer.model) is model,
    }
    stage(result["accelerator"], "gather", lambda: jsonable(accelerator.gather(torch.arange(3))))
    stage(result["accelerator"], "gradient_accumulation_steps", lambda: accelerator.gradient_accumulation_steps)
    result["trainer"] = {
        "is_deepspeed_enabled": trainer.is_deepspeed_enabled,
        "is_fsdp_enabled": trainer.is_fsdp_enabled,
        "place_model_on_device": trainer.place_model_on_device,
        "model_device": str(next(trainer.model.parameters()).device),
        "is_world_process_zero": trainer.is_world_process_zero(),
        "args_is_same_object": trainer.args is args,
    }
    result["files"] = files_under(workdir)
    return result


def attempt(build_args: Callable[[], Any], build_trainer: Callable[[Any], Any]) -> dict[str, Any]:
    """A misconfigured script: where it fails (arguments, Trainer, train) and with which exception."""
    step = "arguments"
    try:
        args = build_args()
        step = "trainer"
        trainer = build_trainer(args)
        step = "train"
        trainer.train()
    except Exception as exc:  # the exception and where it came are what the user sees
        return {"raised_at": step, "outcome": {"error": error(exc)}}
    return {"raised_at": None, "outcome": {"global_step": trainer.state.global_step}}


@scenario
def misconfigurations(impl: Impl, workdir: Path) -> dict[str, Any]:
    """Mistakes users make: which step raises (arguments, Trainer, train) and the exception type and message."""

    def regression(**overrides: Any) -> dict[str, Any]:
        return attempt(
            lambda: training_args(impl, workdir, save_strategy="no", **overrides),
            lambda args: impl.Trainer(model=RegressionModel(), args=args, train_dataset=regression_dataset(16)),
        )

    set_seed(0)
    return {
        "iterable_without_max_steps": attempt(
            lambda: training_args(impl, workdir, save_strategy="no"),
            lambda args: impl.Trainer(model=RegressionModel(), args=args, train_dataset=RegressionStream(16)),
        ),
        "eval_strategy_without_eval_dataset": regression(eval_strategy="steps", eval_steps=1),
        "load_best_with_mismatched_strategies": regression(
            load_best_model_at_end=True, eval_strategy="epoch", save_strategy="steps"
        ),
        "fp16_on_cpu": regression(fp16=True),
        "bf16_without_use_cpu": regression(bf16=True, use_cpu=False),
        "batch_size_zero": regression(per_device_train_batch_size=0),
        "negative_learning_rate": regression(learning_rate=-1.0),
        "plateau_without_evaluation": regression(lr_scheduler_type="reduce_lr_on_plateau"),
        "unknown_optimizer": regression(optim="adamw_nonexistent"),
        "gradient_accumulation_zero": regression(gradient_accumulation_steps=0),
    }
