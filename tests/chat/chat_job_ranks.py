"""The sft and dpo jobs of ``trainer_ext.train`` run uninterrupted and stopped-then-resumed, on however many ranks
this is started with: ``python -m tests.chat.chat_job_ranks OUT`` (one process) or under torchrun (two).

Rank 0 writes each run's per-step losses and final weights under OUT/<name>/ for tests/chat/test_chat_job.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file
from transformers import TrainerCallback

import trainer_ext
from tests.helpers.jobs import StopAt

GLOBAL_BATCH = 8
STEPS = 4
STOP = 2

# name -> its flags; every job's STEPS global batches stay inside the first epoch (a short last batch splits unevenly
# over ranks); packed, 256 conversations make about 80 blocks
JOBS: dict[str, list[str]] = {
    "sft": ["--task", "sft", "--max_train_samples", "64"],
    "sft_packed_fsdp": ["--task", "sft", "--packing", "true", "--fsdp", "full_shard", "--max_train_samples", "256"],
    "dpo": ["--task", "dpo", "--max_train_samples", "64"],
}


class StartedAt(TrainerCallback):
    """Remember the optimizer step training started from (a resume starts where its checkpoint was saved)."""

    step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        StartedAt.step = state.global_step
        return control


def flags(name: str, out: Path, world: int) -> list[str]:
    """The job's flags: the shipped data, 4 optimizer steps of the same global batch, a checkpoint every 2."""
    return [
        *JOBS[name],
        "--output_dir",
        str(out),
        "--max_eval_samples",
        "16",
        "--max_steps",
        str(STEPS),
        "--per_device_train_batch_size",
        str(GLOBAL_BATCH // world),
        "--per_device_eval_batch_size",
        "4",
        "--learning_rate",
        "1e-3",
        "--logging_steps",
        "1",
        "--save_strategy",
        "steps",
        "--save_steps",
        str(STOP),
        "--report_plots",
        "false",
        "--seed",
        "0",
    ]


def losses(out: Path) -> list[float]:
    """The per-step training losses from the run's trainer_state.json."""
    state = json.loads((out / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def run(name: str, base: Path, world: int, rank: int, results: Path) -> None:
    """The uninterrupted run and the run stopped at STOP then resumed; rank 0 copies their results."""
    whole, resumed = base / name / "whole", base / name / "resumed"
    trainer_ext.train(flags(name, whole, world))
    trainer_ext.train(flags(name, resumed, world), callbacks=[StopAt(STOP)])
    trainer_ext.train([*flags(name, resumed, world), "--resume_from_checkpoint", "true"], callbacks=[StartedAt()])
    assert StartedAt.step == STOP, f"{name}: the resumed run started at step {StartedAt.step}, not {STOP}"
    if rank == 0:
        target = results / name
        target.mkdir(parents=True, exist_ok=True)
        for kind, out in (("whole", whole), ("resumed", resumed)):
            (target / f"{kind}_losses.json").write_text(json.dumps(losses(out)))
            weights = out / "model.safetensors"
            assert load_file(weights), f"no weights in {out}"
            shutil.copy(weights, target / f"{kind}.safetensors")


def main(results: Path, names: list[str]) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    base = results / "runs"
    for name in names or list(JOBS):
        run(name, base, world, rank, results)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
