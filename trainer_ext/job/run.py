"""``train(args)``: one fine-tuning job from one arguments object — data, tokenizer, model, Trainer, save.

Every check on user input runs before anything is written to ``output_dir``, so a failed start leaves
nothing there that a later resume could mistake for a checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import datasets
import numpy as np
import transformers
from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

from trainer_ext.distributed import cpu_threads
from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.job import output_dir
from trainer_ext.job.arguments import TrainJobArguments, data_builder, job_arguments_from_dict
from trainer_ext.job.building import SPECIAL_TOKENS as SPECIAL_TOKENS
from trainer_ext.job.building import build_model as build_model
from trainer_ext.job.building import build_tokenizer as build_tokenizer
from trainer_ext.job.building import job_compute_metrics as job_compute_metrics
from trainer_ext.job.building import model_config as model_config
from trainer_ext.job.building import vocab_for as vocab_for
from trainer_ext.job.builtin_data.checks import MAX_CLASSES, bad_json_line, check_data_file, check_rows, class_count
from trainer_ext.job.chat_arguments import CHAT_TASKS
from trainer_ext.job.lora import MERGED_DIR, apply_lora, save_merged
from trainer_ext.job.model_limits import check_job_config
from trainer_ext.job.parallel import auto_parallelism
from trainer_ext.job.trainer_checks import make_trainer, preflight

logger = logging.getLogger(__name__)


def train(
    args: TrainJobArguments | Mapping[str, Any] | Sequence[str],
    callbacks: Sequence[transformers.TrainerCallback] | None = None,
) -> dict[str, float]:
    """Run one job (train, evaluate, save model + tokenizer + config) and return its train and eval metrics.

    ``args`` is the arguments object, a dict of its fields, or command-line flags; ``callbacks`` go to the Trainer.
    With ``lora_r`` the model trains as LoRA adapters and ``output_dir`` receives the adapter (``merge_lora``: also
    the merged model in ``output_dir/merged``, merged in place at the very end).
    """
    args = _as_job_arguments(args)
    auto_parallelism(args)  # an unresolved --parallelism auto: one line, before anything is read or written
    if os.environ.get(cpu_threads.SOURCE) == "policy" or cpu_threads.NUM_THREADS not in os.environ:
        cpu_threads.apply_to_torch(cpu_threads.local_processes())  # torch may have been imported before it was set
    fresh = not os.path.exists(args.output_dir)
    try:
        trainer, tokenized, resume = _set_up(args, callbacks)
    except BaseException:
        if fresh:  # a refused start leaves no trace: not even the empty folder the Trainer made
            _remove_if_empty(args.output_dir)
        raise
    classify = args.task == "sequence-classification"
    report = _attach_report(trainer) if args.report_plots else None
    output_dir.start_run(args, trainer)
    result = trainer.train(resume_from_checkpoint=resume)
    if not _saves_final_model(trainer):  # else UnwrapAndSaveCallback already wrote and checked it
        trainer.save_model()
    metrics = {**result.metrics, "train_samples": len(tokenized["train"])}
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    if "validation" in tokenized:
        eval_metrics = trainer.evaluate()
        eval_metrics["eval_samples"] = len(tokenized["validation"])
        if classify:
            eval_metrics["eval_baseline_accuracy"] = majority_share(tokenized["validation"]["labels"])
        elif (
            "eval_perplexity" not in eval_metrics and args.task != "dpo"
        ):  # --metrics perplexity computes it exactly, per token
            eval_metrics["eval_perplexity"] = math.exp(min(eval_metrics["eval_loss"], 50.0))
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    trainer.save_state()
    if args.merge_lora:  # last: the merge is done in place
        save_merged(trainer, os.path.join(args.output_dir, MERGED_DIR))
    if report is not None:
        report.finish()  # last: the page shows the final evaluation and where the model went
    return {key: float(value) for key, value in metrics.items() if isinstance(value, (int, float))}


def _set_up(
    args: TrainJobArguments, callbacks: Sequence[transformers.TrainerCallback] | None
) -> tuple[transformers.Trainer, datasets.DatasetDict, str | None]:
    """Everything before the first write to ``output_dir``: data, tokenizer, model, the Trainer, every check
    that can fail (optimizer, schedule, the checkpoint to resume from); returns the Trainer, the tokenized data and
    the checkpoint (or None)."""
    if args.process_index == 0 and args.auto_filled:
        filled = ", ".join(f"{k}={v}" for k, v in args.auto_filled.items())
        logger.info("%s job; defaults filled in (any flag overrides them): %s", args.task, filled)
    with args.main_process_first(local=False, desc="loading data"):
        check_job_config(args)  # a model config out of range: one line before any data is read or model built
        raw = load_raw_datasets(args)
    if args.task in CHAT_TASKS:
        from trainer_ext.job.chat_job import set_up_chat

        resume = output_dir.check(args)
        trainer, tokenized = set_up_chat(args, raw, list(callbacks or []))
    else:
        trainer, tokenized, resume = _set_up_text_job(args, raw, callbacks)
    preflight(trainer)
    resume = trainer.resolve_resume(resume)  # a refused checkpoint fails here, before anything is written
    output_dir.check_space(args, trainer)
    if args.run_summary:  # the per-rank memory estimate, and a warning naming the fixing flags when it cannot fit
        from trainer_ext.estimate.startup import startup_estimate

        startup_estimate(trainer)
    return trainer, tokenized, resume


def _set_up_text_job(
    args: TrainJobArguments, raw: datasets.DatasetDict, callbacks: Sequence[transformers.TrainerCallback] | None
) -> tuple[transformers.Trainer, datasets.DatasetDict, str | None]:
    """The classification and causal-lm jobs' columns, tokenizer, model, data and Trainer."""
    from trainer_ext.trainer.trainer import Trainer

    text_column, label_column = resolve_columns(args, raw)
    args.text_column, args.label_column = text_column, label_column  # the job's fingerprint names the real columns
    resume = output_dir.check(args)
    labels = label_names(args, raw, label_column) if label_column else None

    transformers.set_seed(args.seed)  # the same initial weights for a model from scratch on every run and rank
    tokenizer = build_tokenizer(args, raw["train"][text_column])
    model = build_model(args, tokenizer, labels)
    if args.lora_r:
        model = apply_lora(args, model)
    with args.main_process_first(desc="tokenizing"):
        tokenized = tokenize(args, raw, tokenizer, text_column, label_column, labels)

    classify = args.task == "sequence-classification"
    compute_metrics = job_compute_metrics(args, labels)
    collator = (
        DataCollatorWithPadding(tokenizer) if classify else DataCollatorForLanguageModeling(tokenizer, mlm=False)
    )
    trainer = make_trainer(
        Trainer,
        model=model,
        args=args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized.get("validation"),
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
        callbacks=list(callbacks or []),
    )
    return trainer, tokenized, resume


def _remove_if_empty(directory: str) -> None:
    """Remove ``directory`` if it exists and holds nothing (what a refused start may have created)."""
    try:
        os.rmdir(directory)
    except OSError:
        pass


def _attach_report(trainer: transformers.Trainer) -> Any:
    """--report_plots: record the run's events and write output_dir/report at checkpoints and at the end."""
    from trainer_ext.report.callback import attach_report

    return attach_report(trainer)


def _saves_final_model(trainer: transformers.Trainer) -> bool:
    """Whether the Trainer's UnwrapAndSaveCallback (``save_final_model``, or a listed one) writes ``output_dir``."""
    from trainer_ext.callbacks import UnwrapAndSaveCallback

    duty = getattr(trainer.callback_handler, "duty", None)
    callback = duty(UnwrapAndSaveCallback) if duty is not None else None
    return callback is not None and callback.save_final and callback.final_dir is None


def _as_job_arguments(args: TrainJobArguments | Mapping[str, Any] | Sequence[str]) -> TrainJobArguments:
    """Accept the dataclass, a dict of field names, or command-line style strings."""
    if isinstance(args, TrainJobArguments):
        return args
    if isinstance(args, Mapping):
        return job_arguments_from_dict(args)
    if isinstance(args, Sequence) and not isinstance(args, (str, bytes)):
        from trainer_ext.job.flags import parse_train_args

        return parse_train_args(args)
    raise TypeError(f"train() takes TrainJobArguments, a dict or a list of flags, not {type(args).__name__}")


def load_raw_datasets(args: TrainJobArguments) -> datasets.DatasetDict:
    """Load the train split and a validation split (the given one, or held out from train)."""
    try:
        if args.dataset_name:
            raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        else:
            for flag, path in args.data_files().items():
                check_data_file(path, flag)  # still a regular file: a FIFO would hang the loader
            files = {"train": args.train_file}
            if args.validation_file:
                files["validation"] = args.validation_file
            raw = datasets.load_dataset(data_builder(args.train_file), data_files=files)
    except ConfigError:
        raise
    except Exception as error:  # unreadable file, missing hub dataset, no network: all the user's to fix
        source = args.dataset_name or args.train_file
        for path in [] if args.dataset_name else args.data_files().values():
            bad = bad_json_line(path) if data_builder(path) == "json" else None
            if bad:
                raise ConfigError(f"could not load data from {path!r}: {bad}; fix or drop that line") from error
        raise ConfigError(f"could not load data from {source!r}: {_reason(error, args)}") from error
    if "train" not in raw:
        raise ConfigError(f"{args.dataset_name!r} has no 'train' split; its splits: {', '.join(raw)}")
    raw = datasets.DatasetDict({k: raw[k] for k in ("train", "validation") if k in raw})
    sources = {
        split: f"{args.dataset_name!r} ({split} split)"
        if args.dataset_name
        else repr(args.data_files()[f"{split}_file"])
        for split in raw
    }
    if args.task in CHAT_TASKS:  # rows are checked before a split shuffles them
        from trainer_ext.job.chat_job import chat_rows

        raw = chat_rows(args, raw, sources)
    else:
        text_column, label_column = resolve_columns(args, raw)
        check_rows(raw, sources, text_column, label_column, args.num_labels)
    if "validation" not in raw and args.validation_split_percentage > 0:
        try:
            parts = raw["train"].train_test_split(test_size=args.validation_split_percentage / 100, seed=args.seed)
        except ValueError as error:  # e.g. too few rows to hold any out
            raise ConfigError(
                f"cannot hold out {args.validation_split_percentage}% of {len(raw['train'])} training rows for "
                f"evaluation ({error}); pass --validation_file, or --validation_split_percentage 0"
            ) from error
        raw = datasets.DatasetDict(train=parts["train"], validation=parts["test"])
    for split, limit in (("train", args.max_train_samples), ("validation", args.max_eval_samples)):
        if split in raw and limit is not None:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))
    if len(raw["train"]) == 0:
        raise ConfigError(f"no training examples in {args.dataset_name or args.train_file!r}")
    return raw


def _reason(error: Exception, args: TrainJobArguments) -> str:
    """What went wrong loading the data, in words; an empty file often raises with no message at all."""
    said = " ".join(str(error).split())[:500]
    if said:
        return said
    empty = [path for path in args.data_files().values() if os.path.isfile(path) and os.path.getsize(path) == 0]
    if empty:
        return f"{', '.join(repr(p) for p in empty)} is empty (0 bytes): give a file with at least one row"
    return f"{type(error).__name__} with no message (is the data empty, or not in the format its name says?)"


def resolve_columns(args: TrainJobArguments, raw: datasets.DatasetDict) -> tuple[str, str | None]:
    """The text column and (for classification) the label column; ConfigError listing the columns there."""
    columns = raw["train"].column_names
    for split, dataset in raw.items():
        if dataset.column_names != columns:
            raise ConfigError(f"the {split} data has columns {dataset.column_names}, the train data {columns}")

    def check(flag: str, name: str) -> str:
        if name not in columns:
            raise ConfigError(
                f"--{flag} {name!r} is not in the data; its columns: {', '.join(columns)}."
                f"{did_you_mean(name, columns)}"
            )
        return name

    label = None
    if args.task == "sequence-classification":
        if args.label_column:
            label = check("label_column", args.label_column)
        else:
            label = next((c for c in ("label", "labels") if c in columns), None)
            if label is None:
                raise ConfigError(
                    f"no label column in the data (looked for 'label', 'labels'); pass --label_column. "
                    f"Its columns: {', '.join(columns)}"
                )
    elif args.label_column:
        logger.warning("--label_column is ignored for --task causal-lm")
    if args.text_column:
        return check("text_column", args.text_column), label
    if "text" in columns:
        return "text", label
    features = raw["train"].features
    texts = [c for c in columns if c != label and getattr(features[c], "dtype", None) in ("string", "large_string")]
    if len(texts) != 1:
        raise ConfigError(
            f"cannot tell which column holds the text; pass --text_column. Columns: {', '.join(columns)}"
        )
    return texts[0], label


def label_names(args: TrainJobArguments, raw: datasets.DatasetDict, column: str) -> list[str]:
    """The class names in id order: ClassLabel names, sorted strings, or '0'..'n-1' for integer labels."""
    feature = raw["train"].features[column]
    if isinstance(feature, datasets.ClassLabel):
        names = list(feature.names)
    else:
        values = [v for split in raw.values() for v in split[column]]
        if any(v is None for v in values):
            raise ConfigError(f"some rows have no value in the label column {column!r}")
        if all(isinstance(v, str) for v in values):
            names = sorted(set(values))
        elif all(isinstance(v, (int, float)) and float(v).is_integer() and v >= 0 for v in values):
            names = [str(i) for i in range(class_count((int(v) for v in values), args.num_labels, column))]
        else:
            raise ConfigError(
                f"the label column {column!r} must hold class names or class ids 0, 1, 2, …; "
                f"found e.g. {values[0]!r} (regression is not supported)"
            )
    if args.num_labels is not None:
        if args.num_labels > MAX_CLASSES:
            raise ConfigError(f"--num_labels {args.num_labels} is past the {MAX_CLASSES:,} classes a job may have")
        if args.num_labels < len(names):
            raise ConfigError(f"--num_labels {args.num_labels} but the data has {len(names)} classes: {names[:10]}")
        names += [str(i) for i in range(len(names), args.num_labels)]
    if len(names) < 2:
        raise ConfigError(f"the label column {column!r} holds only one class ({names}); classification needs two")
    return names


def tokenize(
    args: TrainJobArguments,
    raw: datasets.DatasetDict,
    tokenizer: transformers.PreTrainedTokenizerBase,
    text_column: str,
    label_column: str | None,
    labels: list[str] | None,
) -> dict[str, datasets.Dataset]:
    """Token ids per example (classification) or fixed-size blocks of concatenated text (causal-lm)."""
    ids = {name: i for i, name in enumerate(labels or [])}

    def encode_classification(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch[text_column], truncation=True, max_length=args.max_seq_length)
        encoded["labels"] = [ids[v] if isinstance(v, str) else int(v) for v in batch[label_column]]
        return encoded

    def encode_blocks(batch: dict[str, list]) -> dict[str, list]:
        texts = [t for t in batch[text_column] if t and t.strip()]
        stream = [token for example in tokenizer(texts)["input_ids"] for token in example]
        size = args.max_seq_length
        blocks = [stream[i : i + size] for i in range(0, len(stream), size)]
        return {"input_ids": blocks, "attention_mask": [[1] * len(b) for b in blocks]}

    encode = encode_classification if label_column else encode_blocks
    return {
        split: dataset.map(
            encode, batched=True, batch_size=1000, remove_columns=dataset.column_names, desc=f"tokenizing {split}"
        )
        for split, dataset in raw.items()
    }


def majority_share(labels: Sequence[int]) -> float:
    """Accuracy of always answering the most frequent class: the bar a model must clear to have learned."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64))
    return float(counts.max() / counts.sum()) if counts.size else 0.0
