"""A `trainer-ext train` job that dies (os._exit, as a kill would: no cleanup) after optimizer step N.

Usage: python crash_job.py N FLAG...  (the flags of `trainer-ext train`)
"""

from __future__ import annotations

import os
import sys

from transformers import TrainerCallback

import trainer_ext


class DieAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os._exit(3)


if __name__ == "__main__":
    from trainer_ext.report import callback

    callback.REFRESH_RATIO = 0  # a report at every checkpoint, however short the run
    trainer_ext.train(sys.argv[2:], callbacks=[DieAt(int(sys.argv[1]))])
