"""``save_total_limit=1`` with ``load_best_model_at_end``: which checkpoints a job leaves, and when.

    python -m tests.checkpointing.best_limit_job OUT (ours|stock) [preempt]    (1 process, or N under torchrun)

A small regression job evaluates and saves every 2 steps; ``metric_for_best_model="loss"`` with
``greater_is_better=True`` makes the first evaluation (the highest loss) the best, so the best checkpoint is the
oldest. Rank 0 writes ``OUT/result.json``: the folders after each save (as ``on_save`` sees them), at
``on_train_end``, the limit callbacks read, the best checkpoint, and how training ended. ``stock`` runs
transformers' own Trainer (it needs accelerate); ``preempt`` sends SIGUSR1 during step 5 (``save_on_preemption``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from transformers import TrainerCallback

STEPS = 8
PREEMPT_STEP = 5


def folders(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda name: int(name.split("-")[1]))


class Observe(TrainerCallback):
    """The checkpoint folders after every save and at the end of training, and the limit callbacks read."""

    def __init__(self, out: Path) -> None:
        self.out, self.saves, self.limits, self.at_train_end = out, [], [], None

    def on_save(self, args, state, control, **kwargs):
        self.saves.append(folders(self.out))
        self.limits.append(args.save_total_limit)

    def on_train_end(self, args, state, control, **kwargs):
        self.at_train_end = folders(self.out)


class Preempt(TrainerCallback):
    """SIGUSR1 to this process during step ``PREEMPT_STEP``, as a scheduler sends it."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == PREEMPT_STEP - 1:
            os.kill(os.getpid(), signal.SIGUSR1)


def run(out: Path, impl: str, preempt: bool = False) -> dict:
    """The job under ``impl`` ("ours" or "stock"); what rank 0 observed (every rank returns its own)."""
    from tests.test_trainer_dropin import Regression, Rows

    if impl == "stock":
        from transformers import Trainer, TrainingArguments
    else:
        from trainer_ext import Trainer, TrainingArguments
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = {"save_on_preemption": True} if preempt else {}
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4 // world,
        per_device_eval_batch_size=4,
        max_steps=STEPS,
        learning_rate=0.05,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,  # the highest eval loss, the first one, is "best": the best checkpoint is the oldest
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **extra,
    )
    observe = Observe(out)
    callbacks = [observe, Preempt()] if preempt else [observe]
    trainer = Trainer(
        model=Regression(), args=args, train_dataset=Rows(64), eval_dataset=Rows(16), callbacks=callbacks
    )
    ended = "finished"
    try:
        trainer.train()
    except SystemExit as stop:  # ours: Preempted (exit code 75) after the preemption's checkpoint
        ended = f"exit {stop.code}"
    best = trainer.state.best_model_checkpoint
    return {
        "saves": observe.saves,
        "limits": observe.limits,
        "at_train_end": observe.at_train_end,
        "best": Path(best).name if best else None,
        "ended": ended,
        "limit_after": trainer.args.save_total_limit,
    }


def main(out: str, impl: str, *flags: str) -> None:
    result = run(Path(out), impl, preempt="preempt" in flags)
    result["left"] = folders(Path(out))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
