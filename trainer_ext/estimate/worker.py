"""One rank of ``trainer-ext estimate --measure``: two optimizer steps of the job, measured.

``python -m trainer_ext.estimate.worker OUT_DIR TRAIN_FLAGS...`` (under torch.distributed.run for several ranks).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer_ext.estimate.measure import MeasureCallback

# appended last, so they override the job's own: two steps, nothing saved, evaluated or reported
RUN_FLAGS = (
    "--max_steps=2",
    "--save_strategy=no",
    "--eval_strategy=no",
    "--report_to=none",
    "--save_final_model=false",
    "--run_summary=false",
    "--logging_steps=1",
    "--validation_split_percentage=0",
    "--overwrite_output_dir=true",
)


def launch_ranks(
    module: str, train_argv: Sequence[str], num_processes: int, out_dir: str, timeout: float | None = None
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run the worker ``module`` (``python -m module OUT_DIR TRAIN_FLAGS...``) on ``num_processes`` local ranks under
    torch.distributed.run, one thread each; the finished process and each rank's ``rank{N}.json``, in rank order."""
    from trainer_ext import env_vars

    env = {k: v for k, v in os.environ.items() if k not in env_vars.TORCHRUN_VARS}
    env.setdefault("OMP_NUM_THREADS", "1")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}"]
    cmd = [*run, "--max_restarts=0", "-m", module, out_dir, *train_argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    paths = sorted(glob.glob(os.path.join(out_dir, "rank*.json")), key=lambda p: int(p.rsplit("rank", 1)[1][:-5]))
    ranks = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            ranks.append(json.load(handle))
    return proc, ranks


def output_tail(proc: subprocess.CompletedProcess, lines: int = 25) -> str:
    """The last ``lines`` lines of a finished run's output, for its error message."""
    return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-lines:])


def main(argv: Sequence[str]) -> int:
    from trainer_ext.estimate.measure import MeasureCallback
    from trainer_ext.job.flags import parse_train_args
    from trainer_ext.job.run import train

    out_dir, train_argv = argv[0], list(argv[1:])
    run_dir = os.path.join(out_dir, "run")  # the same on every rank; the caller removes out_dir
    args = parse_train_args([*train_argv, *RUN_FLAGS, f"--output_dir={run_dir}"])
    callback = MeasureCallback(out_dir)
    _hand_reference(callback)
    train(args, callbacks=[callback])
    return 0


def _hand_reference(callback: MeasureCallback) -> None:
    """Give ``callback`` a dpo job's reference model as the job makes it (``chat_job.reference_model``, which
    ``set_up_chat`` calls by name), so that it counts its weights: no callback argument carries it."""
    from trainer_ext.job import chat_job

    make = chat_job.reference_model

    def handed(*args: Any, **kwargs: Any) -> Any:
        callback.reference = make(*args, **kwargs)
        return callback.reference

    chat_job.reference_model = handed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
