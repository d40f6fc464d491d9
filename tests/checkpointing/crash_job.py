"""A 2-rank training job for the fault-tolerance tests, run with ``trainer-ext launch``.

``trainer-ext launch -m tests.checkpointing.crash_job OUT MODE [STRATEGY]`` (STRATEGY ``ddp``, the default,
``fsdp`` or ``deepspeed``): MODE ``full`` trains uninterrupted; ``crash`` SIGKILLs rank 1 at step 5 in the first
attempt only (TORCHELASTIC_RESTART_COUNT=0); ``die`` SIGKILLs rank 1 at step 3 every time; ``preempt`` sends
SIGUSR1 to rank 1 at step 3 with the ranks agreeing on it every step; ``preempt_auto`` the same with the default
agreement interval (about every 2 s of training, and at the last step). Every mode resumes with ``"auto"``; rank 0 writes the
final weights and the checkpoint it resumed from.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from safetensors.torch import save_file
from transformers import TrainerCallback

from tests.helpers.jobs import make_args, weights
from tests.helpers.paths import CONFIGS
from tests.helpers.tiny import lm_dataset, tiny_llama
from trainer_ext import Trainer


class Fault(TrainerCallback):
    """Send ``sig`` to this process at the end of step ``step`` on rank 1 (first attempt only if ``once``)."""

    def __init__(self, step: int, sig: int, once: bool) -> None:
        self.step, self.sig, self.once = step, sig, once

    def on_step_end(self, args, state, control, **kwargs):
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if state.global_step == self.step and args.process_index == 1 and (first or not self.once):
            os.kill(os.getpid(), self.sig)
        return control


STRATEGIES = {
    "ddp": {},
    "fsdp": {"fsdp": True},
    "deepspeed": {"deepspeed": str(CONFIGS / "deepspeed" / "zero3.json")},
}


def main(out: str, mode: str, strategy: str = "ddp") -> None:
    faults = {
        "crash": Fault(5, signal.SIGKILL, once=True),
        "die": Fault(3, signal.SIGKILL, once=False),
        "preempt": Fault(3, signal.SIGUSR1, once=False),
        "preempt_auto": Fault(3, signal.SIGUSR1, once=False),
    }
    check_steps = {"preempt": 1}.get(mode)
    args = make_args(
        out,
        save_strategy="steps",
        save_steps=2,
        num_train_epochs=2,
        ddp_timeout=30,
        save_on_preemption=True,
        preemption_check_steps=check_steps,
        **STRATEGIES[strategy],
    )
    trainer = Trainer(
        model=tiny_llama(0),
        args=args,
        train_dataset=lm_dataset(24, seed=3),
        callbacks=[faults[mode]] if mode in faults else [],
    )
    resumed_from = trainer.resolve_resume("auto")
    trainer.train(resume_from_checkpoint=resumed_from)
    final = weights(trainer) if strategy == "ddp" else trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if args.process_index == 0:
        save_file({k: v.contiguous() for k, v in final.items()}, str(Path(out) / "final.safetensors"))
        info = {"resumed_from": resumed_from and Path(resumed_from).name, "steps": trainer.state.global_step}
        (Path(out) / "result.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main(*sys.argv[1:4])
