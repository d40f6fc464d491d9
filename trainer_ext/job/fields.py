"""The model and data fields of a job, and the checks on them that need neither torch nor transformers.

Split from ``trainer_ext.job.arguments`` so that ``trainer-ext train`` can check a path, a preset or a task before the
heavy imports; ``TrainJobArguments`` inherits both dataclasses.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.job.builtin_data import CHAT, CORPUS, PREFERENCES, SENTIMENT
from trainer_ext.job.builtin_data.checks import check_data_file

TASKS = ("sequence-classification", "causal-lm", "sft", "dpo")

# Model configs small enough to train in seconds on a CPU; vocab_size comes from the tokenizer.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-bert": dict(
        model_type="bert",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    # tiny-llama with 4 layers and its own lm_head: what pipeline parallelism splits (untied embeddings, a layer per
    # stage even with 2 stages per rank on pp 2)
    "tiny-llama-untied": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    "tiny-gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=2, n_positions=256),
}
DEFAULT_PRESET = {
    "sequence-classification": "tiny-bert",
    "causal-lm": "tiny-llama",
    "sft": "tiny-llama",
    "dpo": "tiny-llama",
}
SHIPPED_DATA = {
    "sequence-classification": SENTIMENT,
    "causal-lm": CORPUS,
    "sft": CHAT,
    "dpo": PREFERENCES,
}

# `datasets` builder for each supported data-file extension.
DATA_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
    ".parquet": "parquet",
}

_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def looks_local(name: str) -> bool:
    """True when ``name`` can only be a filesystem path, not a hub id like ``org/model``."""
    return name.startswith((".", "~", os.sep)) or "\\" in name or not _HUB_ID.fullmatch(name) or name.endswith(".json")


def field_help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class ModelArguments:
    """Which model to train, for which task, and from where its weights or config come."""

    model_name_or_path: str | None = field(
        default=None,
        metadata=field_help(
            "Pretrained model to fine-tune: a local directory or a hub id (needs network). "
            "Leave unset to train a small model from scratch (see --model_config)."
        ),
    )
    model_config: str | None = field(
        default=None,
        metadata=field_help(
            f"Train from scratch from this config: a config.json path, a directory holding one, or a "
            f"preset ({', '.join(PRESETS)}). Default: {DEFAULT_PRESET['sequence-classification']} for "
            f"sequence-classification, {DEFAULT_PRESET['causal-lm']} for the others."
        ),
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata=field_help(
            "Tokenizer (directory or hub id). Default: the model's own; for a model from scratch, a "
            "word-level tokenizer built from the training texts."
        ),
    )
    task: str = field(
        default="sequence-classification",
        metadata=field_help(
            f"One of: {', '.join(TASKS)} (sft: supervised fine-tuning on chat, instruction or plain text data; dpo: "
            "preference training on chosen/rejected pairs)."
        ),
    )
    num_labels: int | None = field(
        default=None,
        metadata=field_help("Number of classes (sequence-classification). Default: inferred from the data."),
    )
    trust_remote_code: bool = field(
        default=False,
        metadata=field_help("Allow model code from the hub repository to run (only for repos you trust)."),
    )

    @property
    def from_scratch(self) -> bool:
        """True when the model is built from a config instead of loaded from pretrained weights."""
        return self.model_name_or_path is None

    def validate_model(self) -> None:
        """Normalise the task and check model, config and tokenizer names; raise ConfigError on bad input."""
        task = self.task.strip().lower().replace("_", "-")
        if task not in TASKS:
            raise ConfigError(
                f"unknown --task {self.task!r}; choose one of {', '.join(TASKS)}.{did_you_mean(task, TASKS)}"
            )
        self.task = task
        if self.model_name_or_path and self.model_config:
            raise ConfigError(
                "--model_name_or_path and --model_config both given: pass --model_name_or_path to fine-tune a "
                "pretrained model, or --model_config to train a new one from a config, not both"
            )
        for flag in ("model_name_or_path", "tokenizer_name"):
            name = getattr(self, flag)
            if name and looks_local(name) and not os.path.exists(os.path.expanduser(name)):
                raise ConfigError(f"--{flag} {name!r}: no such file or directory. Check the path.")
        if self.model_config and not os.path.exists(os.path.expanduser(self.model_config)):
            if looks_local(self.model_config) or "/" in self.model_config:
                raise ConfigError(f"--model_config {self.model_config!r}: no such file or directory. Check the path.")
            if self.model_config not in PRESETS:
                raise ConfigError(
                    f"--model_config {self.model_config!r} is neither a file nor a preset; presets: "
                    f"{', '.join(PRESETS)}.{did_you_mean(self.model_config, PRESETS)}"
                )
        if self.num_labels is not None and self.num_labels < 1:
            raise ConfigError(f"--num_labels must be at least 1, got {self.num_labels}")


@dataclass
class DataArguments:
    """Where the training and evaluation texts come from and how they are cut."""

    dataset_name: str | None = field(
        default=None,
        metadata=field_help("A `datasets` hub dataset (needs network). Mutually exclusive with --train_file."),
    )
    dataset_config_name: str | None = field(default=None, metadata=field_help("Configuration of --dataset_name."))
    train_file: str | None = field(
        default=None,
        metadata=field_help(
            f"Training data: {', '.join(sorted(DATA_BUILDERS))}. Default: the data shipped with "
            "trainer_ext for the task (no network)."
        ),
    )
    validation_file: str | None = field(
        default=None, metadata=field_help("Evaluation data, same format as --train_file.")
    )
    validation_split_percentage: int = field(
        default=10,
        metadata=field_help(
            "Percent of the training data held out for evaluation when there is no validation file "
            "or split (0 = no evaluation)."
        ),
    )
    text_column: str | None = field(
        default=None,
        metadata=field_help("Column holding the text. Default: 'text' if present, else the only text column."),
    )
    label_column: str | None = field(
        default=None,
        metadata=field_help("Column holding the class (sequence-classification). Default: 'label' or 'labels'."),
    )
    max_seq_length: int = field(
        default=128,
        metadata=field_help("Longest sequence in tokens; longer texts are truncated (causal-lm: block size)."),
    )
    max_train_samples: int | None = field(default=None, metadata=field_help("Use only the first N training examples."))
    max_eval_samples: int | None = field(
        default=None, metadata=field_help("Use only the first N evaluation examples.")
    )

    def validate_data(self) -> None:
        """Check data files, extensions and numeric ranges; raise ConfigError on bad input."""
        if self.dataset_name and self.train_file:
            raise ConfigError("--dataset_name and --train_file both given: use one source of training data")
        if self.validation_file and not (self.train_file or self.dataset_name):
            raise ConfigError("--validation_file needs --train_file too (the shipped data brings its own split)")
        builders = {data_builder(path, flag) for flag, path in self.data_files().items()}
        if len(builders) > 1:
            raise ConfigError(f"--train_file and --validation_file must have the same format, got {sorted(builders)}")
        if not 0 <= self.validation_split_percentage < 100:
            raise ConfigError(
                f"--validation_split_percentage must be in [0, 100), got {self.validation_split_percentage}"
            )
        for flag in ("max_train_samples", "max_eval_samples"):
            if getattr(self, flag) is not None and getattr(self, flag) < 1:
                raise ConfigError(f"--{flag} must be at least 1, got {getattr(self, flag)}")

    def data_files(self) -> dict[str, str]:
        """The given data files by flag name (train_file, validation_file)."""
        return {k: v for k, v in (("train_file", self.train_file), ("validation_file", self.validation_file)) if v}


def data_builder(path: str, flag: str = "train_file") -> str:
    """The `datasets` builder name for a data file; ConfigError if missing or of an unsupported type."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in DATA_BUILDERS:
        raise ConfigError(
            f"--{flag} {path!r}: unsupported file type {suffix or '(none)'!r}; use one of "
            f"{', '.join(sorted(DATA_BUILDERS))}"
        )
    check_data_file(path, flag)  # a FIFO, a device or a folder is named as such, never opened
    return DATA_BUILDERS[suffix]
