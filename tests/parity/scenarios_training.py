"""Parity scenarios about what is trained and on what: models, datasets, data loaders, samplers, evaluation sets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import default_data_collator, set_seed

from .observe import BatchTap, weights
from .registry import Impl, scenario
from .script import Script, evaluate, predict, train
from .workload import (
    RegressionModel,
    RegressionModelWithOutput,
    RegressionStream,
    RegressionTorchDataset,
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
    args = training_args(impl, workdir, eval_strategy="epoch")
    train_set, eval_set = regression_dataset(40), regression_dataset(18, 1, 1000)
    script = Script(impl, workdir, model, args, train_set, eval_set, tap=True)
    return script.run(train(), evaluate())


@scenario
def custom_module_model_output(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A plain nn.Module returning a ModelOutput; compute_metrics; predict on a test set of 13."""
    set_seed(0)
    model = RegressionModelWithOutput()
    args = training_args(impl, workdir, eval_strategy="epoch", save_strategy="epoch")
    train_set, eval_set = regression_dataset(40), regression_dataset(18, 1, 1000)
    script = Script(impl, workdir, model, args, train_set, eval_set, tap=True, compute_metrics=regression_metrics)
    return script.run(train(), predict(regression_dataset(13, 2, 2000)))


@scenario
def llama_causal_lm(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A tiny LlamaForCausalLM from a config: train, evaluate, predict, then save_model to a folder."""
    set_seed(0)
    model = tiny_llama()
    args = training_args(impl, workdir, learning_rate=1e-3, per_device_train_batch_size=4, warmup_steps=2)
    train_set, eval_set = token_dataset(24), token_dataset(10, first_id=30, seed=1)
    script = Script(impl, workdir, model, args, train_set, eval_set, tap=True)
    save_model = ("save_model", lambda trainer: trainer.save_model(str(workdir / "final")))
    return script.run(train(), evaluate(), predict(token_dataset(5, first_id=50, seed=2)), save_model)


@scenario
def bert_sequence_classification(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A tiny BertForSequenceClassification, label smoothing, evaluation every 2 steps with accuracy; predict."""
    set_seed(0)
    model = tiny_bert()
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
    train_set, eval_set = classification_dataset(30), classification_dataset(14, first_id=40, seed=1)
    script = Script(impl, workdir, model, args, train_set, eval_set, tap=True, compute_metrics=accuracy)
    return script.run(train(), predict(classification_dataset(9, first_id=60, seed=2)))


@scenario
def iterable_dataset(impl: Impl, workdir: Path) -> dict[str, Any]:
    """A torch IterableDataset for training (max_steps) and evaluation (18 samples, batches of 8)."""
    set_seed(0)
    model = RegressionModel()
    args = training_args(impl, workdir, max_steps=8, eval_strategy="steps", eval_steps=4, save_steps=4)
    train_set, eval_set = RegressionStream(24), RegressionStream(18, 1, 1000)
    script = Script(impl, workdir, model, args, train_set, eval_set, tap=True, compute_metrics=regression_metrics)
    return script.run(train(), evaluate(), predict(RegressionStream(11, 2, 2000)))


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
    args = training_args(impl, workdir, per_device_train_batch_size=6, save_strategy="no")
    script = Script(impl, workdir, model, args, RegressionTorchDataset(27), tap=True, trainer_class=MyTrainer)
    return script.run(train())


@scenario
def eval_multiple_sets(impl: Impl, workdir: Path) -> dict[str, Any]:
    """eval_dataset as a dict of two sets: metric key names during training, from evaluate() and a prefix."""
    set_seed(0)
    model = RegressionModel()
    args = training_args(impl, workdir, eval_strategy="epoch", save_strategy="no")
    train_set = regression_dataset(24)
    eval_sets = {"small": regression_dataset(5, 1, 1000), "large": regression_dataset(19, 2, 2000)}
    script = Script(impl, workdir, model, args, train_set, eval_sets, tap=True, compute_metrics=regression_metrics)
    return script.run(
        train(),
        evaluate(),
        evaluate("evaluate_one_named", eval_dataset="small"),
        evaluate("evaluate_prefix", eval_dataset=regression_dataset(7, 3, 3000), metric_key_prefix="test"),
    )


@scenario
def model_init(impl: Impl, workdir: Path) -> dict[str, Any]:
    """model_init instead of a model: the Trainer seeds and builds the model itself."""
    tap = BatchTap()
    built: list[str] = []

    def make_model():
        built.append("model")
        return tap.attach(RegressionModel())

    args = training_args(impl, workdir, save_strategy="no")
    script = Script(impl, workdir, None, args, regression_dataset(24), tap=tap, model_init=make_model)
    script.result["initial_weights"] = weights(script.trainer.model)
    return script.run(train(), models_built=lambda _: len(built))


@scenario
def sampler_options(impl: Impl, workdir: Path) -> dict[str, Any]:
    """train_sampling_strategy="group_by_length", data_seed and dataloader_drop_last: which samples each step sees."""
    set_seed(0)
    model = tiny_llama()
    args = training_args(
        impl,
        workdir,
        train_sampling_strategy="group_by_length",
        data_seed=123,
        dataloader_drop_last=True,
        per_device_train_batch_size=3,
        learning_rate=1e-3,
        save_strategy="no",
    )
    return Script(impl, workdir, model, args, token_dataset(20, ragged=True), tap=True).run(train())


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
    args = training_args(impl, workdir, dataloader_num_workers=2, save_strategy="no")
    return Script(impl, workdir, model, args, NoisyDataset(24), tap=True).run(train())


@scenario
def evaluate_only(impl: Impl, workdir: Path) -> dict[str, Any]:
    """No training at all: evaluate() and predict() on a fresh model, with eval_accumulation_steps."""
    set_seed(0)
    model = tiny_bert()
    args = training_args(impl, workdir, eval_accumulation_steps=2, per_device_eval_batch_size=4)
    eval_set = classification_dataset(14, first_id=40)
    script = Script(impl, workdir, model, args, tap=True, eval_dataset=eval_set, compute_metrics=accuracy)
    return script.run(evaluate(), predict(classification_dataset(9, first_id=60)))


@scenario
def split_batches(impl: Impl, workdir: Path) -> dict[str, Any]:
    """accelerator_config={"split_batches": True} on one process."""
    set_seed(0)
    model = RegressionModel()
    args = training_args(impl, workdir, accelerator_config={"split_batches": True}, save_strategy="no")
    train_set, eval_set = regression_dataset(20), regression_dataset(11, 1, 1000)
    script = Script(impl, workdir, model, args, train_set, eval_set, tap=True)
    return script.run(train(), evaluate())


@scenario
def even_batches_false(impl: Impl, workdir: Path) -> dict[str, Any]:
    """accelerator_config={"even_batches": False} on one process: evaluation and prediction of 18 samples."""
    set_seed(0)
    model = RegressionModel()
    args = training_args(impl, workdir, accelerator_config={"even_batches": False}, save_strategy="no")
    train_set, eval_set = regression_dataset(20), regression_dataset(18, 1, 1000)
    script = Script(impl, workdir, model, args, train_set, eval_set, tap=True, compute_metrics=regression_metrics)
    return script.run(train(), predict(regression_dataset(18, 1, 1000)))
