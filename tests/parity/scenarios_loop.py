"""Parity scenarios about the training loop: callbacks, best model, optimizers, accumulation, losses, precision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import EarlyStoppingCallback, PrinterCallback, ProgressCallback, set_seed

from .observe import Recorder, callback_names, jsonable
from .registry import Impl, scenario
from .script import Script, evaluate, train
from .workload import (
    LossLoggerCallback,
    RegressionModel,
    RegressionModelWithKwargs,
    StepCounterCallback,
    regression_dataset,
    regression_metrics,
    tiny_llama,
    token_dataset,
    training_args,
)


@scenario
def callbacks_add_pop_remove(impl: Impl, workdir: Path) -> dict[str, Any]:
    """add_callback (class and instance), pop_callback, remove_callback; the list after each call."""
    set_seed(0)
    args = training_args(impl, workdir, save_strategy="no", num_train_epochs=1)
    script = Script(impl, workdir, RegressionModel(), args, regression_dataset(16), record=False)
    trainer, result = script.trainer, script.result
    result["after_init"] = callback_names(trainer)
    trainer.add_callback(StepCounterCallback)
    result["after_add_class"] = callback_names(trainer)
    logger_callback = LossLoggerCallback()
    trainer.add_callback(logger_callback)
    result["after_add_instance"] = callback_names(trainer)
    popped = trainer.pop_callback(PrinterCallback)
    result["popped"] = type(popped).__name__ if popped is not None else None
    result["after_pop_printer"] = callback_names(trainer)
    missing = trainer.pop_callback(ProgressCallback)
    result["popped_missing"] = type(missing).__name__ if missing is not None else None
    trainer.remove_callback(StepCounterCallback)
    result["after_remove_class"] = callback_names(trainer)
    trainer.remove_callback(logger_callback)
    result["after_remove_instance"] = callback_names(trainer)
    trainer.add_callback(logger_callback)
    trainer.add_callback(popped)
    result["after_re_adding"] = callback_names(trainer)
    script.recorder = Recorder(trainer)
    return script.run(train(), user_callback_losses=lambda _: jsonable(logger_callback.losses))


@scenario
def callbacks_passed_in(impl: Impl, workdir: Path) -> dict[str, Any]:
    """callbacks=[...] with the user's own callback, a second PrinterCallback and an EarlyStoppingCallback."""
    set_seed(0)
    logger_callback = LossLoggerCallback()
    args = training_args(
        impl,
        workdir,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        num_train_epochs=3,
        learning_rate=0.01,
    )
    callbacks = [logger_callback, PrinterCallback(), EarlyStoppingCallback(early_stopping_patience=1)]
    train_set, eval_set = regression_dataset(24), regression_dataset(10, 1, 1000)
    script = Script(impl, workdir, RegressionModel(), args, train_set, eval_set, callbacks=callbacks)
    return script.run(train(), user_callback_losses=lambda _: jsonable(logger_callback.losses))


@scenario
def load_best_model_at_end(impl: Impl, workdir: Path) -> dict[str, Any]:
    """load_best_model_at_end, metric_for_best_model, save_total_limit=2: checkpoints kept, best checkpoint."""
    set_seed(0)
    model = RegressionModel()
    args = training_args(
        impl,
        workdir,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        save_total_limit=2,
        load_best_model_at_end=True,
        # the largest error is the first evaluation: the best checkpoint is the oldest one
        metric_for_best_model="mse",
        greater_is_better=True,
        num_train_epochs=3,
    )
    train_set, eval_set = regression_dataset(24), regression_dataset(10, 1, 1000)
    script = Script(impl, workdir, model, args, train_set, eval_set, compute_metrics=regression_metrics)
    return script.run(train(), evaluate())


@scenario
def custom_optimizer_scheduler(impl: Impl, workdir: Path) -> dict[str, Any]:
    """optimizers=(SGD with momentum, LambdaLR) built by the user."""
    set_seed(0)
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    args = training_args(impl, workdir, save_strategy="epoch")
    script = Script(impl, workdir, model, args, regression_dataset(32), optimizers=(optimizer, scheduler))
    return script.run(
        train(),
        optimizer_is_users=lambda trainer: (
            trainer.optimizer is optimizer or getattr(trainer.optimizer, "optimizer", None) is optimizer
        ),
        scheduler_last_lr=lambda _: jsonable(scheduler.get_last_lr()),
    )


@scenario
def reduce_lr_on_plateau(impl: Impl, workdir: Path) -> dict[str, Any]:
    """lr_scheduler_type="reduce_lr_on_plateau" driven by the evaluation every epoch."""
    set_seed(0)
    args = training_args(
        impl,
        workdir,
        lr_scheduler_type="reduce_lr_on_plateau",
        lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "threshold": 0.5},
        eval_strategy="epoch",
        save_strategy="no",
        num_train_epochs=4,
    )
    train_set, eval_set = regression_dataset(24), regression_dataset(10, 1, 1000)
    script = Script(impl, workdir, RegressionModel(), args, train_set, eval_set)
    return script.run(train(), scheduler=lambda trainer: type(trainer.lr_scheduler).__name__)


@scenario
def adafactor(impl: Impl, workdir: Path) -> dict[str, Any]:
    """optim="adafactor" on a tiny Llama."""
    set_seed(0)
    model = tiny_llama()
    args = training_args(impl, workdir, optim="adafactor", learning_rate=1e-3, per_device_train_batch_size=4)
    script = Script(impl, workdir, model, args, token_dataset(16))
    return script.run(
        train(), optimizer=lambda trainer: type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__
    )


@scenario
def gradient_accumulation(impl: Impl, workdir: Path) -> dict[str, Any]:
    """gradient_accumulation_steps=3 with 10 batches an epoch (the last accumulation of each epoch is partial)."""
    set_seed(0)
    model = RegressionModel()
    args = training_args(
        impl, workdir, per_device_train_batch_size=4, gradient_accumulation_steps=3, save_strategy="no"
    )
    return Script(impl, workdir, model, args, regression_dataset(40), tap=True).run(train())


@scenario
def gradient_accumulation_llama(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A tiny Llama with padded rows and gradient_accumulation_steps=2: the loss counts tokens over the steps."""
    set_seed(0)
    model = tiny_llama()
    args = training_args(
        impl,
        workdir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        save_strategy="no",
        num_train_epochs=1,
    )
    return Script(impl, workdir, model, args, token_dataset(20, ragged=True), tap=True).run(train())


@scenario
def gradient_accumulation_kwargs_model(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A forward(**kwargs) model that ignores num_items_in_batch, gradient_accumulation_steps=2, plain SGD."""
    set_seed(0)
    model = RegressionModelWithKwargs()
    args = training_args(
        impl,
        workdir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        save_strategy="no",
        optim="sgd",
        learning_rate=0.01,
        max_grad_norm=0.0,  # no clipping: it would hide the size of the gradients
    )
    script = Script(impl, workdir, model, args, regression_dataset(24), tap=True)
    script.result["model_accepts_loss_kwargs"] = script.trainer.model_accepts_loss_kwargs
    return script.run(train())


@scenario
def custom_compute_loss(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A Trainer subclass overriding compute_loss (smooth L1), gradient_accumulation_steps=2, evaluation."""

    class MyTrainer(impl.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = nn.functional.smooth_l1_loss(outputs["logits"], labels)
            return (loss, outputs) if return_outputs else loss

    set_seed(0)
    model = RegressionModel()
    args = training_args(
        impl, workdir, gradient_accumulation_steps=2, per_device_train_batch_size=4, save_strategy="no"
    )
    train_set, eval_set = regression_dataset(24), regression_dataset(10, 1, 1000)
    script = Script(impl, workdir, model, args, train_set, eval_set, trainer_class=MyTrainer)
    return script.run(train(), evaluate())


@scenario
def compute_loss_func(impl: Impl, workdir: Path) -> dict[str, Any]:
    """Trainer(compute_loss_func=...) on a tiny Llama with padded rows and gradient_accumulation_steps=2."""

    def token_loss(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"][:, :-1].float()
        targets = labels[:, 1:]
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return loss / num_items_in_batch if num_items_in_batch is not None else loss / (targets != -100).sum()

    set_seed(0)
    args = training_args(
        impl,
        workdir,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        save_strategy="no",
        num_train_epochs=1,
    )
    train_set = token_dataset(12, ragged=True)
    script = Script(impl, workdir, tiny_llama(), args, train_set, compute_loss_func=token_loss)
    return script.run(train())


@scenario
def bf16_on_cpu(impl: Impl, workdir: Path) -> dict[str, Any]:
    """bf16=True on CPU (autocast to bfloat16), a tiny Llama; evaluate too."""
    set_seed(0)
    model = tiny_llama()
    args = training_args(
        impl, workdir, bf16=True, per_device_train_batch_size=4, learning_rate=1e-3, save_strategy="no"
    )
    script = Script(impl, workdir, model, args, token_dataset(16), token_dataset(6, first_id=30))
    return script.run(train(), evaluate(), parameter_dtype=lambda trainer: str(next(trainer.model.parameters()).dtype))


@scenario
def gradient_checkpointing(impl: Impl, workdir: Path) -> dict[str, Any]:
    """gradient_checkpointing=True on a tiny Llama."""
    set_seed(0)
    args = training_args(
        impl,
        workdir,
        gradient_checkpointing=True,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        num_train_epochs=1,
    )
    return Script(impl, workdir, tiny_llama(), args, token_dataset(16)).run(train())


@scenario
def memory_metrics(impl: Impl, workdir: Path) -> dict[str, Any]:
    """skip_memory_metrics=False: which memory metric keys train() and evaluate() report."""
    set_seed(0)
    args = training_args(impl, workdir, skip_memory_metrics=False, save_strategy="no", num_train_epochs=1)
    train_set, eval_set = regression_dataset(16), regression_dataset(10, 1, 1000)
    script = Script(impl, workdir, RegressionModel(), args, train_set, eval_set, record=False)
    return script.run(train(), evaluate())


@scenario
def auto_find_batch_size(impl: Impl, workdir: Path) -> dict[str, Any]:
    """auto_find_batch_size=True on CPU (nothing runs out of memory: the batch size stays as given)."""
    set_seed(0)
    model = RegressionModel()
    args = training_args(impl, workdir, auto_find_batch_size=True, save_strategy="no")
    script = Script(impl, workdir, model, args, regression_dataset(24), tap=True)
    return script.run(train(), train_batch_size=lambda trainer: trainer._train_batch_size)
