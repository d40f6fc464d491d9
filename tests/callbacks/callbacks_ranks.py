"""Jobs for the callback tests, run on 1 rank in pytest and on 2 gloo ranks under torchrun.

``python -m tests.callbacks.callbacks_ranks OUT`` (under torchrun) runs, in one launch: a training job with every
callback (logging, barriers, checks of saves, throughput, a NaN injected on rank 1 only), then a job where rank 1
arrives late at a barrier. Each rank writes ``OUT/rank<r>.json``; rank 0 also writes ``OUT/weights.safetensors``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast, TrainerCallback
from transformers.utils import logging as hf_logging

from tests.helpers.jobs import make_args, weights
from tests.helpers.tiny import VOCAB, lm_dataset, tiny_llama
from trainer_ext import Trainer
from trainer_ext.callbacks import (
    BarrierCallback,
    BarrierTimeoutError,
    MainProcessLoggingCallback,
    NaNGuardCallback,
    ThroughputCallback,
    UnwrapAndSaveCallback,
)

NAN_PARAMETER = "model.layers.1.mlp.down_proj.weight"


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' vocabulary (built here, no hub)."""
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )


class RecordingTrainer(Trainer):
    """Keeps this rank's loss of every training step (what each rank adds to the logged loss)."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_losses = [*getattr(self, "step_losses", []), float(loss)]
        return loss


class NaNGradientAt(TrainerCallback):
    """Makes one parameter's gradient NaN during the backward of optimizer step ``step`` (1-based)."""

    def __init__(self, trainer: Trainer, step: int, parameter: str = NAN_PARAMETER, ranks: tuple[int, ...] = (0,)):
        self.trainer, self.step, self.parameter, self.ranks = trainer, step, parameter, ranks
        self._handle = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step and args.process_index in self.ranks:
            param = dict(self.trainer.model.named_parameters())[self.parameter]
            self._handle = param.register_hook(lambda grad: grad * float("nan"))

    def on_step_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class WeightsPerStep(TrainerCallback):
    """Sum of all weights after each optimizer step (index 0: before training)."""

    def __init__(self) -> None:
        self.sums: list[float] = []

    def _record(self, model) -> None:
        self.sums.append(float(sum(p.detach().double().sum() for p in model.parameters())))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._record(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._record(model)


def capture_logs() -> list[str]:
    """Emit one record per level on a user logger and on a transformers logger, plus a warning; return what shows."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    hf_root = logging.getLogger("transformers")
    # transformers' records reach the root logger only where it propagates (it does when CI=1 is set)
    targets = [logging.getLogger()] + ([] if hf_root.propagate else [hf_root])
    for logger in targets:
        logger.addHandler(handler)
    try:
        user, library = logging.getLogger("callbacks_test"), hf_logging.get_logger("transformers.callbacks_test")
        for logger, name in ((user, "user"), (library, "transformers")):
            logger.info("%s info line", name)
            logger.warning("%s warning line", name)
        stream.write(warnings.formatwarning("python warning line", UserWarning, "job.py", 1))
    finally:
        for logger in targets:
            logger.removeHandler(handler)
    return [line for line in stream.getvalue().splitlines() if line.strip()]


def train_job(out: Path, *, nan_ranks: tuple[int, ...] = (1,)) -> tuple[dict, dict]:
    """4 steps of 2 per rank, logged every 2, evaluated and saved at step 2 and 4, a NaN gradient at step 3."""
    logging.basicConfig(level=logging.INFO)  # what many training scripts do: every rank would print INFO
    trainer = RecordingTrainer(
        model=tiny_llama(0),
        args=make_args(
            out,
            max_steps=4,
            logging_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            log_level="info",
        ),
        train_dataset=lm_dataset(16),
        eval_dataset=lm_dataset(4, seed=2),
        processing_class=tiny_tokenizer(),
    )
    logs = MainProcessLoggingCallback(trainer)
    barrier, saves, throughput = (
        BarrierCallback(timeout=60),
        UnwrapAndSaveCallback(trainer),
        ThroughputCallback(trainer),
    )
    guard, per_step = NaNGuardCallback("skip"), WeightsPerStep()
    for callback in (logs, barrier, saves, throughput, NaNGradientAt(trainer, 3, ranks=nan_ranks), guard, per_step):
        trainer.add_callback(callback)
    trainer.train()
    result = {
        "rank": trainer.args.process_index,
        "log_history": trainer.state.log_history,
        "step_losses": trainer.step_losses,
        "logs": capture_logs(),
        "barriers": barrier.passed,
        "verified": [str(Path(p).relative_to(out)) for p in saves.verified],
        "throughput_window": throughput.last_window,
        "nan_events": [[e.step, e.parameter, e.loss_non_finite] for e in guard.events],
        "weight_sums": per_step.sums,
    }
    logs.restore()
    return result, weights(trainer)


class LateAt(TrainerCallback):
    """Rank ``rank`` sleeps ``seconds`` at the end of step ``step`` (before the barrier callbacks after it)."""

    def __init__(self, rank: int, step: int, seconds: float) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    def on_step_end(self, args, state, control, **kwargs):
        if args.process_index == self.rank and state.global_step == self.step:
            time.sleep(self.seconds)


def late_rank_job(out: Path) -> str:
    """Rank 1 is 4 s late at the checkpoint barrier of step 2 (timeout 1.5 s): the error each rank gets."""
    trainer = Trainer(
        model=tiny_llama(0),
        args=make_args(out, max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=lm_dataset(8),
        callbacks=[LateAt(rank=1, step=2, seconds=4.0), BarrierCallback(timeout=1.5)],
    )
    try:
        trainer.train()
    except BarrierTimeoutError as error:
        return f"BarrierTimeoutError: {error} | stage={error.stage} | missing={error.missing}"
    return "no error"


def main(out: str) -> None:
    out_dir = Path(out)
    rank = int(os.environ["RANK"])
    result, final_weights = train_job(out_dir / "train")
    if rank == 0:
        save_file(final_weights, str(out_dir / "weights.safetensors"))
    result["late_rank"] = late_rank_job(out_dir / "late")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    # after a failed monitored barrier the group is unusable: leave without tearing it down (it would wait)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
