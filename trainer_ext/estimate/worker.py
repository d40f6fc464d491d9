"""One rank of ``trainer-ext estimate --measure``: two optimizer steps of the job, measured.

``python -m trainer_ext.estimate.worker OUT_DIR TRAIN_FLAGS...`` (under torch.distributed.run for several ranks).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

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


def main(argv: Sequence[str]) -> int:
    from trainer_ext.estimate.measure import MeasureCallback
    from trainer_ext.job.flags import parse_train_args
    from trainer_ext.job.run import train

    out_dir, train_argv = argv[0], list(argv[1:])
    run_dir = os.path.join(out_dir, "run")  # the same on every rank; the caller removes out_dir
    args = parse_train_args([*train_argv, *RUN_FLAGS, f"--output_dir={run_dir}"])
    train(args, callbacks=[MeasureCallback(out_dir)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
