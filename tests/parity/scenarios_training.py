"""Parity scenarios about training itself: models, data, callbacks, evaluation, optimizers, accumulation, precision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import (
    EarlyStoppingCallback,
    PrinterCallback,
    ProgressCallback,
    default_data_collator,
    set_seed,
)

from .observe import (
    BatchTap,
    Recorder,
    callback_names,
    finish,
    jsonable,
    metrics,
    prediction_output,
    stage,
    train_output,
    weights,
)
from .registry import Impl, scenario
from .workload import (
    LossLoggerCallback,
    RegressionModel,
    RegressionModelWithKwargs,
    RegressionModelWithOutput,
    RegressionStream,
    RegressionTorchDataset,
    StepCounterCallback,
    accuracy,
    classification_dataset,
    regression_dataset,
    regression_metrics,
    tiny_bert,
    tiny_llama,
    token_dataset,
    training_args,
)


@scenario
def custom_module_dict(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A plain nn.Module (config None) returning a dict; datasets.Dataset; eval set of 18 with batches of 8."""
    set_seed(0)
    model = RegressionModel()
    tap = BatchTap(model)
    args = training_args(impl, workdir, eval_strategy="epoch")
    trainer = impl.Trainer(
        model=model, args=args, train_dataset=regression_dataset(40), eval_dataset=regression_dataset(18, 1, 1000)
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(result, "evaluate", lambda: metrics(trainer.evaluate()))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def custom_module_model_output(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A plain nn.Module returning a ModelOutput; compute_metrics; predict on a test set of 13."""
    set_seed(0)
    model = RegressionModelWithOutput()
    tap = BatchTap(model)
    args = training_args(impl, workdir, eval_strategy="epoch", save_strategy="epoch")
    trainer = impl.Trainer(
        model=model,
        args=args,
        train_dataset=regression_dataset(40),
        eval_dataset=regression_dataset(18, 1, 1000),
        compute_metrics=regression_metrics,
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(result, "predict", lambda: prediction_output(trainer.predict(regression_dataset(13, 2, 2000))))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def llama_causal_lm(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A tiny LlamaForCausalLM from a config: train, evaluate, predict, then save_model to a folder."""
    set_seed(0)
    model = tiny_llama()
    tap = BatchTap(model)
    args = training_args(impl, workdir, learning_rate=1e-3, per_device_train_batch_size=4, warmup_steps=2)
    trainer = impl.Trainer(
        model=model, args=args, train_dataset=token_dataset(24), eval_dataset=token_dataset(10, first_id=30, seed=1)
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(result, "evaluate", lambda: metrics(trainer.evaluate()))
    stage(result, "predict", lambda: prediction_output(trainer.predict(token_dataset(5, first_id=50, seed=2))))
    stage(result, "save_model", lambda: trainer.save_model(str(workdir / "final")))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def bert_sequence_classification(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A tiny BertForSequenceClassification, label smoothing, evaluation every 2 steps with accuracy; predict."""
    set_seed(0)
    model = tiny_bert()
    tap = BatchTap(model)
    args = training_args(
        impl,
        workdir,
        learning_rate=1e-3,
        eval_strategy="steps",
        eval_steps=2,
        num_train_epochs=1,
        save_strategy="no",
        label_smoothing_factor=0.1,
    )
    trainer = impl.Trainer(
        model=model,
        args=args,
        train_dataset=classification_dataset(30),
        eval_dataset=classification_dataset(14, first_id=40, seed=1),
        compute_metrics=accuracy,
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(
        result, "predict", lambda: prediction_output(trainer.predict(classification_dataset(9, first_id=60, seed=2)))
    )
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def iterable_dataset(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A torch IterableDataset for training (max_steps) and evaluation (18 samples, batches of 8)."""
    set_seed(0)
    model = RegressionModel()
    tap = BatchTap(model)
    args = training_args(impl, workdir, max_steps=8, eval_strategy="steps", eval_steps=4, save_steps=4)
    trainer = impl.Trainer(
        model=model,
        args=args,
        train_dataset=RegressionStream(24),
        eval_dataset=RegressionStream(18, 1, 1000),
        compute_metrics=regression_metrics,
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(result, "evaluate", lambda: metrics(trainer.evaluate()))
    stage(result, "predict", lambda: prediction_output(trainer.predict(RegressionStream(11, 2, 2000))))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def custom_train_dataloader(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A Trainer subclass whose get_train_dataloader returns a plain, seeded, shuffling DataLoader."""

    class MyTrainer(impl.Trainer):
        def get_train_dataloader(self):
            generator = torch.Generator().manual_seed(7)
            return DataLoader(
                self.train_dataset,
                batch_size=self.args.per_device_train_batch_size,
                shuffle=True,
                generator=generator,
                collate_fn=default_data_collator,
            )

    set_seed(0)
    model = RegressionModel()
    tap = BatchTap(model)
    args = training_args(impl, workdir, per_device_train_batch_size=6, save_strategy="no")
    trainer = MyTrainer(model=model, args=args, train_dataset=RegressionTorchDataset(27))
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def callbacks_add_pop_remove(impl: Impl, workdir: Path) -> dict[str, Any]:
    """add_callback (class and instance), pop_callback, remove_callback; the list after each call."""
    set_seed(0)
    args = training_args(impl, workdir, save_strategy="no", num_train_epochs=1)
    trainer = impl.Trainer(model=RegressionModel(), args=args, train_dataset=regression_dataset(16))
    result: dict[str, Any] = {"after_init": callback_names(trainer)}
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
    recorder = Recorder(trainer)
    stage(result, "train", lambda: train_output(trainer.train()))
    result["user_callback_losses"] = jsonable(logger_callback.losses)
    return finish(result, trainer, workdir, recorder, None)


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
    trainer = impl.Trainer(
        model=RegressionModel(),
        args=args,
        train_dataset=regression_dataset(24),
        eval_dataset=regression_dataset(10, 1, 1000),
        callbacks=[logger_callback, PrinterCallback(), EarlyStoppingCallback(early_stopping_patience=1)],
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    result["user_callback_losses"] = jsonable(logger_callback.losses)
    return finish(result, trainer, workdir, recorder, None)


@scenario
def eval_multiple_sets(impl: Impl, workdir: Path) -> dict[str, Any]:
    """eval_dataset as a dict of two sets: metric key names during training, from evaluate() and a prefix."""
    set_seed(0)
    model = RegressionModel()
    tap = BatchTap(model)
    args = training_args(impl, workdir, eval_strategy="epoch", save_strategy="no")
    trainer = impl.Trainer(
        model=model,
        args=args,
        train_dataset=regression_dataset(24),
        eval_dataset={"small": regression_dataset(5, 1, 1000), "large": regression_dataset(19, 2, 2000)},
        compute_metrics=regression_metrics,
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(result, "evaluate", lambda: metrics(trainer.evaluate()))
    stage(result, "evaluate_one_named", lambda: metrics(trainer.evaluate(eval_dataset="small")))
    stage(
        result,
        "evaluate_prefix",
        lambda: metrics(trainer.evaluate(regression_dataset(7, 3, 3000), metric_key_prefix="test")),
    )
    return finish(result, trainer, workdir, recorder, tap)


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
    trainer = impl.Trainer(
        model=model,
        args=args,
        train_dataset=regression_dataset(24),
        eval_dataset=regression_dataset(10, 1, 1000),
        compute_metrics=regression_metrics,
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(result, "evaluate", lambda: metrics(trainer.evaluate()))
    return finish(result, trainer, workdir, recorder, None)


@scenario
def custom_optimizer_scheduler(impl: Impl, workdir: Path) -> dict[str, Any]:
    """optimizers=(SGD with momentum, LambdaLR) built by the user."""
    set_seed(0)
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    args = training_args(impl, workdir, save_strategy="epoch")
    trainer = impl.Trainer(
        model=model, args=args, train_dataset=regression_dataset(32), optimizers=(optimizer, scheduler)
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    result["optimizer_is_users"] = (
        trainer.optimizer is optimizer or getattr(trainer.optimizer, "optimizer", None) is optimizer
    )
    result["scheduler_last_lr"] = jsonable(scheduler.get_last_lr())
    return finish(result, trainer, workdir, recorder, None)


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
    trainer = impl.Trainer(
        model=RegressionModel(),
        args=args,
        train_dataset=regression_dataset(24),
        eval_dataset=regression_dataset(10, 1, 1000),
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    result["scheduler"] = type(trainer.lr_scheduler).__name__
    return finish(result, trainer, workdir, recorder, None)


@scenario
def adafactor(impl: Impl, workdir: Path) -> dict[str, Any]:
    """optim="adafactor" on a tiny Llama."""
    set_seed(0)
    model = tiny_llama()
    args = training_args(impl, workdir, optim="adafactor", learning_rate=1e-3, per_device_train_batch_size=4)
    trainer = impl.Trainer(model=model, args=args, train_dataset=token_dataset(16))
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    result["optimizer"] = type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__
    return finish(result, trainer, workdir, recorder, None)


@scenario
def model_init(impl: Impl, workdir: Path) -> dict[str, Any]:
    """model_init instead of a model: the Trainer seeds and builds the model itself."""
    tap = BatchTap()
    built: list[str] = []

    def make_model():
        built.append("model")
        return tap.attach(RegressionModel())

    args = training_args(impl, workdir, save_strategy="no")
    trainer = impl.Trainer(model_init=make_model, args=args, train_dataset=regression_dataset(24))
    recorder = Recorder(trainer)
    result: dict[str, Any] = {"initial_weights": weights(trainer.model)}
    stage(result, "train", lambda: train_output(trainer.train()))
    result["models_built"] = len(built)
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def gradient_accumulation(impl: Impl, workdir: Path) -> dict[str, Any]:
    """gradient_accumulation_steps=3 with 10 batches an epoch (the last accumulation of each epoch is partial)."""
    set_seed(0)
    model = RegressionModel()
    tap = BatchTap(model)
    args = training_args(
        impl, workdir, per_device_train_batch_size=4, gradient_accumulation_steps=3, save_strategy="no"
    )
    trainer = impl.Trainer(model=model, args=args, train_dataset=regression_dataset(40))
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def gradient_accumulation_llama(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A tiny Llama with padded rows and gradient_accumulation_steps=2: the loss counts tokens over the steps."""
    set_seed(0)
    model = tiny_llama()
    tap = BatchTap(model)
    args = training_args(
        impl,
        workdir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        save_strategy="no",
        num_train_epochs=1,
    )
    trainer = impl.Trainer(model=model, args=args, train_dataset=token_dataset(20, ragged=True))
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def gradient_accumulation_kwargs_model(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A forward(**kwargs) model that ignores num_items_in_batch, gradient_accumulation_steps=2, plain SGD."""
    set_seed(0)
    model = RegressionModelWithKwargs()
    tap = BatchTap(model)
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
    trainer = impl.Trainer(model=model, args=args, train_dataset=regression_dataset(24))
    recorder = Recorder(trainer)
    result: dict[str, Any] = {"model_accepts_loss_kwargs": trainer.model_accepts_loss_kwargs}
    stage(result, "train", lambda: train_output(trainer.train()))
    return finish(result, trainer, workdir, recorder, tap)


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
    trainer = MyTrainer(
        model=model, args=args, train_dataset=regression_dataset(24), eval_dataset=regression_dataset(10, 1, 1000)
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(result, "evaluate", lambda: metrics(trainer.evaluate()))
    return finish(result, trainer, workdir, recorder, None)


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
    trainer = impl.Trainer(
        model=tiny_llama(), args=args, train_dataset=token_dataset(12, ragged=True), compute_loss_func=token_loss
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    return finish(result, trainer, workdir, recorder, None)


@scenario
def sampler_options(impl: Impl, workdir: Path) -> dict[str, Any]:
    """group_by_length, data_seed and dataloader_drop_last: which samples each step sees."""
    set_seed(0)
    model = tiny_llama()
    tap = BatchTap(model)
    args = training_args(
        impl,
        workdir,
        group_by_length=True,
        data_seed=123,
        dataloader_drop_last=True,
        per_device_train_batch_size=3,
        learning_rate=1e-3,
        save_strategy="no",
    )
    trainer = impl.Trainer(model=model, args=args, train_dataset=token_dataset(20, ragged=True))
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def dataloader_workers(impl: Impl, workdir: Path) -> dict[str, Any]:
    """dataloader_num_workers=2 over a dataset that adds random noise per sample (worker seeding shows)."""

    class NoisyDataset(RegressionTorchDataset):
        def __getitem__(self, i: int) -> dict[str, Any]:
            item = super().__getitem__(i)
            item["x"] = item["x"] + 0.1 * torch.randn(4)
            return item

    set_seed(0)
    model = RegressionModel()
    tap = BatchTap(model)
    args = training_args(impl, workdir, dataloader_num_workers=2, save_strategy="no")
    trainer = impl.Trainer(model=model, args=args, train_dataset=NoisyDataset(24))
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def bf16_on_cpu(impl: Impl, workdir: Path) -> dict[str, Any]:
    """bf16=True on CPU (autocast to bfloat16), a tiny Llama; evaluate too."""
    set_seed(0)
    model = tiny_llama()
    args = training_args(
        impl, workdir, bf16=True, per_device_train_batch_size=4, learning_rate=1e-3, save_strategy="no"
    )
    trainer = impl.Trainer(
        model=model, args=args, train_dataset=token_dataset(16), eval_dataset=token_dataset(6, first_id=30)
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(result, "evaluate", lambda: metrics(trainer.evaluate()))
    result["parameter_dtype"] = str(next(trainer.model.parameters()).dtype)
    return finish(result, trainer, workdir, recorder, None)


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
    trainer = impl.Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(16))
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    return finish(result, trainer, workdir, recorder, None)


@scenario
def evaluate_only(impl: Impl, workdir: Path) -> dict[str, Any]:
    """No training at all: evaluate() and predict() on a fresh model, with eval_accumulation_steps."""
    set_seed(0)
    model = tiny_bert()
    tap = BatchTap(model)
    args = training_args(impl, workdir, eval_accumulation_steps=2, per_device_eval_batch_size=4)
    trainer = impl.Trainer(
        model=model, args=args, eval_dataset=classification_dataset(14, first_id=40), compute_metrics=accuracy
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "evaluate", lambda: metrics(trainer.evaluate()))
    stage(result, "predict", lambda: prediction_output(trainer.predict(classification_dataset(9, first_id=60))))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def memory_metrics(impl: Impl, workdir: Path) -> dict[str, Any]:
    """skip_memory_metrics=False: which memory metric keys train() and evaluate() report."""
    set_seed(0)
    args = training_args(impl, workdir, skip_memory_metrics=False, save_strategy="no", num_train_epochs=1)
    trainer = impl.Trainer(
        model=RegressionModel(),
        args=args,
        train_dataset=regression_dataset(16),
        eval_dataset=regression_dataset(10, 1, 1000),
    )
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(result, "evaluate", lambda: metrics(trainer.evaluate()))
    return finish(result, trainer, workdir, None, None)


@scenario
def split_batches(impl: Impl, workdir: Path) -> dict[str, Any]:
    """accelerator_config={"split_batches": True} on one process."""
    set_seed(0)
    model = RegressionModel()
    tap = BatchTap(model)
    args = training_args(impl, workdir, accelerator_config={"split_batches": True}, save_strategy="no")
    trainer = impl.Trainer(
        model=model, args=args, train_dataset=regression_dataset(20), eval_dataset=regression_dataset(11, 1, 1000)
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(result, "evaluate", lambda: metrics(trainer.evaluate()))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def even_batches_false(impl: Impl, workdir: Path) -> dict[str, Any]:
    """accelerator_config={"even_batches": False} on one process: evaluation and prediction of 18 samples."""
    set_seed(0)
    model = RegressionModel()
    tap = BatchTap(model)
    args = training_args(impl, workdir, accelerator_config={"even_batches": False}, save_strategy="no")
    trainer = impl.Trainer(
        model=model,
        args=args,
        train_dataset=regression_dataset(20),
        eval_dataset=regression_dataset(18, 1, 1000),
        compute_metrics=regression_metrics,
    )
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    stage(result, "predict", lambda: prediction_output(trainer.predict(regression_dataset(18, 1, 1000))))
    return finish(result, trainer, workdir, recorder, tap)


@scenario
def auto_find_batch_size(impl: Impl, workdir: Path) -> dict[str, Any]:
    """auto_find_batch_size=True on CPU (nothing runs out of memory: the batch size stays as given)."""
    set_seed(0)
    model = RegressionModel()
    tap = BatchTap(model)
    args = training_args(impl, workdir, auto_find_batch_size=True, save_strategy="no")
    trainer = impl.Trainer(model=model, args=args, train_dataset=regression_dataset(24))
    recorder = Recorder(trainer)
    result: dict[str, Any] = {}
    stage(result, "train", lambda: train_output(trainer.train()))
    result["train_batch_size"] = trainer._train_batch_size
    return finish(result, trainer, workdir, recorder, tap)
