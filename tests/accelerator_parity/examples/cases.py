"""Which of accelerate's example scripts run, with which of their own arguments, in which phases.

A phase is one launch in the case's working folder (shared by its phases: a resumed phase reads the checkpoint the
phase before it wrote). Every case runs on each of ``NPROCS`` processes under both implementations.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parent / "upstream"
NPROCS = (1, 2)
CPU = ("--cpu",)  # the scripts need it to be MULTI_CPU under torchrun without a GPU (README: known behaviour)


@dataclass(frozen=True)
class Case:
    name: str
    script: str  # under upstream/
    phases: tuple[tuple[str, tuple[str, ...]], ...]  # (phase, the script's arguments)
    needs: str | None = None  # a module the script imports that this environment may lack

    def missing(self) -> str | None:
        """Why the case cannot run here (its module is not installed), or None."""
        if self.needs and importlib.util.find_spec(self.needs) is None:
            return f"{self.script} imports {self.needs}, which is not installed"
        return None


def _run(*args: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return (("run", (*CPU, *args)),)


def _resumed(every: str, resume_from: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """A run that checkpoints every ``every`` (``epoch`` or a step count), then a new process resuming from the
    checkpoint folder ``resume_from`` (the run's own, in the same working folder)."""
    save = (*CPU, "--checkpointing_steps", every)
    return (("full", save), ("resumed", (*save, "--resume_from_checkpoint", resume_from)))


CASES = {
    case.name: case
    for case in (
        Case("nlp_example", "nlp_example.py", _run()),
        # after epoch 0; mid-epoch (6 batches on 1 process: epoch 0 skips 4; 3 a rank on 2: epoch 1 skips 1)
        Case("complete_nlp_example", "complete_nlp_example.py", _resumed("epoch", "epoch_0")),
        Case("checkpointing", "by_feature/checkpointing.py", _resumed("4", "step_4")),
        Case(
            "gradient_accumulation", "by_feature/gradient_accumulation.py", _run("--gradient_accumulation_steps", "2")
        ),
        Case("early_stopping", "by_feature/early_stopping.py", _run()),
        Case(
            "local_sgd",
            "by_feature/local_sgd.py",
            _run("--gradient_accumulation_steps", "2", "--local_sgd_steps", "2"),
        ),
        Case("memory", "by_feature/memory.py", _run()),
        Case("multi_process_metrics", "by_feature/multi_process_metrics.py", _run()),
        Case("tracking", "by_feature/tracking.py", _run("--with_tracking")),
        Case("automatic_gradient_accumulation", "by_feature/automatic_gradient_accumulation.py", _run()),
        Case("ddp_comm_hook", "by_feature/ddp_comm_hook.py", _run("--ddp_comm_hook", "fp16")),
        Case("profiler", "by_feature/profiler.py", _run()),
        # its Accelerator ignores --cpu (fsdp_plugin only): ACCELERATE_USE_CPU (batch.py) stands for `launch --cpu`
        Case(
            "fsdp_with_peak_mem_tracking",
            "by_feature/fsdp_with_peak_mem_tracking.py",
            _run("--model_name_or_path", "bert-base-cased"),
        ),
        Case("schedule_free", "by_feature/schedule_free.py", _run(), needs="schedulefree"),
        Case("cross_validation", "by_feature/cross_validation.py", _run("--num_folds", "2"), needs="sklearn"),
    )
}
