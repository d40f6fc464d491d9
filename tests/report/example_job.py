"""``trainer_ext.train(FLAGS)`` with the report rewritten at every checkpoint (no rate limit), keeping the first
checkpoint's report as ``first_checkpoint_report.html`` beside the run folder.

Usage: python example_job.py FLAG...  (the flags of `trainer-ext train`)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from transformers import TrainerCallback

import trainer_ext


class KeepFirstReport(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        page = Path(args.output_dir) / "report" / "report.html"
        kept = Path(args.output_dir).parent / "first_checkpoint_report.html"
        if page.is_file() and not kept.exists():
            shutil.copy(page, kept)


if __name__ == "__main__":
    from trainer_ext.report import callback

    callback.REFRESH_RATIO = 0  # a report at every checkpoint, however short the run
    trainer_ext.train(sys.argv[1:], callbacks=[KeepFirstReport()])
