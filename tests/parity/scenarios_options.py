"""Parity scenarios for the Trainer's less travelled options: evaluation hooks, schedules, NEFTune, early
stopping, and ``Seq2SeqTrainer`` generating its predictions (``trainer_ext.Seq2SeqTrainer`` on our side)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    EarlyStoppingCallback,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)

from tests.helpers.tiny import copy_rows, tiny_t5

from .registry import Impl, scenario
from .script import Script, evaluate, predict, train
from .workload import tiny_llama, token_dataset, training_args


def preprocess_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What run_clm.py keeps of the logits for its accuracy: the predicted token ids."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def token_metrics(eval_pred: Any) -> dict[str, float]:
    """Next-token accuracy and the sum of the preprocessed ids, and what include_for_metrics adds (inputs, losses)."""
    predictions, labels = eval_pred.predictions[:, :-1], eval_pred.label_ids[:, 1:]
    mask = labels != -100
    return {
        "token_accuracy": float((predictions[mask] == labels[mask]).mean()),
        "predicted_ids_sum": float(eval_pred.predictions.sum()),
        "inputs_sum": float(np.asarray(eval_pred.inputs).sum()),
        "losses_mean": float(np.asarray(eval_pred.losses).mean()),
    }


@scenario
def evaluation_hooks_and_schedules(impl: Impl, workdir: Path) -> dict[str, Any]:
    """preprocess_logits_for_metrics with include_for_metrics, eval_on_start, logging_first_step, cosine restarts
    with lr_scheduler_kwargs, warm-up as a fraction, NEFTune, and early stopping on the best checkpoint."""
    set_seed(0)
    args = training_args(
        impl,
        workdir,
        learning_rate=1e-3,
        per_device_train_batch_size=4,
        num_train_epochs=4,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        save_total_limit=2,
        eval_on_start=True,
        logging_first_step=True,
        logging_steps=2,
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs={"num_cycles": 2},
        warmup_steps=0.25,
        neftune_noise_alpha=5.0,
        include_for_metrics=["inputs", "loss"],
        load_best_model_at_end=True,
        metric_for_best_model="token_accuracy",
        greater_is_better=True,
    )
    train_set, eval_set = token_dataset(16), token_dataset(6, first_id=30, seed=1, ragged=True)
    script = Script(
        impl,
        workdir,
        tiny_llama(),
        args,
        train_set,
        eval_set,
        tap=True,
        compute_metrics=token_metrics,
        preprocess_logits_for_metrics=preprocess_logits,
        callbacks=[EarlyStoppingCallback(early_stopping_patience=2)],
    )
    return script.run(
        train(),
        evaluate(),
        best_checkpoint=lambda trainer: Path(trainer.state.best_model_checkpoint or "").name,
        learning_rates=lambda trainer: [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e],
    )


def generation_metrics(eval_pred: Any) -> dict[str, float]:
    """Exact match of the generated ids (pad -100s) against the labels, and the generated length."""
    predictions = np.where(eval_pred.predictions == -100, 0, eval_pred.predictions)
    labels = np.where(eval_pred.label_ids == -100, 0, eval_pred.label_ids)
    width = min(predictions.shape[1] - 1, labels.shape[1])
    return {
        "exact": float((predictions[:, 1 : 1 + width] == labels[:, :width]).all(axis=1).mean()),
        "generated_tokens": float((predictions != 0).sum()),
        "width": float(predictions.shape[1]),
    }


@scenario
def seq2seq_predict_with_generate(impl: Impl, workdir: Path) -> dict[str, Any]:
    """Seq2SeqTrainer with predict_with_generate: evaluation and prediction generate (greedy and beam search);
    our side imports both classes from trainer_ext instead (transformers' arguments class needs accelerate)."""
    if impl.name == "stock":
        trainer_class, arguments_class = Seq2SeqTrainer, Seq2SeqTrainingArguments
    else:
        import trainer_ext

        trainer_class, arguments_class = trainer_ext.Seq2SeqTrainer, trainer_ext.Seq2SeqTrainingArguments
    set_seed(0)
    args = arguments_class(
        output_dir=str(workdir / "out"),
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_steps=1,
        seed=42,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=3,
        learning_rate=3e-3,
        num_train_epochs=2,
        eval_strategy="epoch",
        save_strategy="epoch",
        predict_with_generate=True,
        generation_max_length=8,
    )
    train_set, eval_set = copy_rows(16, 0), copy_rows(7, 1)
    script = Script(
        impl,
        workdir,
        tiny_t5(),
        args,
        train_set,
        eval_set,
        tap=True,
        trainer_class=trainer_class,
        compute_metrics=generation_metrics,
    )
    test_set = copy_rows(5, 2)
    return script.run(
        train(),
        evaluate(),
        evaluate("evaluate_beams", num_beams=2, max_new_tokens=4),
        predict(test_set),
        args_class=lambda trainer: type(trainer.args).__name__,
    )
