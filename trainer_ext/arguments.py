"""The arguments of one fine-tuning job: model and data fields plus every TrainingArguments flag.

``TrainJobArguments`` is the one object ``trainer_ext.train`` takes. Cheap checks (paths, extensions,
presets, flag combinations) run when it is built, so bad input fails before anything is written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .data import CORPUS, SENTIMENT
from .errors import ConfigError, did_you_mean
from .field_types import check_field_types
from .lora_arguments import LORA_ALPHA_PER_RANK, LORA_DROPOUT, LoraArguments
from .metrics_arguments import MetricsArguments
from .training_args import TrainingArguments
from .values import normalize_keys, parse_size

MAX_SEQ_LENGTH = 1 << 20  # tokens: a from-scratch model's position table is sized from it
# values the Trainer takes besides what the field's annotation says (a config file may write them so)
LOOSER_TYPES: dict[str, tuple[type, ...]] = {
    "fsdp": (bool, list),
    "resume_from_checkpoint": (bool,),
    "debug": (type(None),),  # HfArgumentParser's own default for it
}

TASKS = ("sequence-classification", "causal-lm")

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
    "tiny-gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=2, n_positions=256),
}
DEFAULT_PRESET = {"sequence-classification": "tiny-bert", "causal-lm": "tiny-llama"}
SHIPPED_DATA = {"sequence-classification": SENTIMENT, "causal-lm": CORPUS}

# `datasets` builder for each supported data-file extension.
DATA_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
    ".parquet": "parquet",
}

# Values for TrainingArguments fields left unset (None), most specific layer first: the built-in job saves no
# checkpoints (it takes seconds); small models from scratch want larger steps and batches than fine-tuning a
# pretrained model, where transformers' own defaults apply.
AUTO_DEFAULTS: dict[str, dict[str, Any]] = {
    "builtin": dict(save_strategy="no"),
    "builtin-causal-lm": dict(num_train_epochs=10.0),
    "scratch": dict(
        learning_rate=2e-3, per_device_train_batch_size=32, per_device_eval_batch_size=64, logging_steps=25
    ),
    "pretrained": dict(
        learning_rate=5e-5, per_device_train_batch_size=8, per_device_eval_batch_size=8, logging_steps=500
    ),
    "any": dict(save_strategy="steps", num_train_epochs=3.0),
}

_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def looks_local(name: str) -> bool:
    """True when ``name`` can only be a filesystem path, not a hub id like ``org/model``."""
    return name.startswith((".", "~", os.sep)) or "\\" in name or not _HUB_ID.fullmatch(name) or name.endswith(".json")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class ModelArguments:
    """Which model to train, for which task, and from where its weights or config come."""

    model_name_or_path: str | None = field(
        default=None,
        metadata=_help(
            "Pretrained model to fine-tune: a local directory or a hub id (needs network). "
            "Leave unset to train a small model from scratch (see --model_config)."
        ),
    )
    model_config: str | None = field(
        default=None,
        metadata=_help(
            f"Train from scratch from this config: a config.json path, a directory holding one, or a "
            f"preset ({', '.join(PRESETS)}). Default: {DEFAULT_PRESET['sequence-classification']} for "
            f"sequence-classification, {DEFAULT_PRESET['causal-lm']} for causal-lm."
        ),
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata=_help(
            "Tokenizer (directory or hub id). Default: the model's own; for a model from scratch, a "
            "word-level tokenizer built from the training texts."
        ),
    )
    task: str = field(default="sequence-classification", metadata=_help(f"One of: {', '.join(TASKS)}."))
    num_labels: int | None = field(
        default=None, metadata=_help("Number of classes (sequence-classification). Default: inferred from the data.")
    )
    trust_remote_code: bool = field(
        default=False, metadata=_help("Allow model code from the hub repository to run (only for repos you trust).")
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
        default=None, metadata=_help("A `datasets` hub dataset (needs network). Mutually exclusive with --train_file.")
    )
    dataset_config_name: str | None = field(default=None, metadata=_help("Configuration of --dataset_name."))
    train_file: str | None = field(
        default=None,
        metadata=_help(
            f"Training data: {', '.join(sorted(DATA_BUILDERS))}. Default: the data shipped with "
            "trainer_ext for the task (no network)."
        ),
    )
    validation_file: str | None = field(default=None, metadata=_help("Evaluation data, same format as --train_file."))
    validation_split_percentage: int = field(
        default=10,
        metadata=_help(
            "Percent of the training data held out for evaluation when there is no validation file "
            "or split (0 = no evaluation)."
        ),
    )
    text_column: str | None = field(
        default=None, metadata=_help("Column holding the text. Default: 'text' if present, else the only text column.")
    )
    label_column: str | None = field(
        default=None,
        metadata=_help("Column holding the class (sequence-classification). Default: 'label' or 'labels'."),
    )
    max_seq_length: int = field(
        default=128, metadata=_help("Longest sequence in tokens; longer texts are truncated (causal-lm: block size).")
    )
    max_train_samples: int | None = field(default=None, metadata=_help("Use only the first N training examples."))
    max_eval_samples: int | None = field(default=None, metadata=_help("Use only the first N evaluation examples."))

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
    if not os.path.isfile(path):
        raise ConfigError(f"--{flag} {path!r}: no such file. Check the path.")
    return DATA_BUILDERS[suffix]


@dataclass
class TrainJobArguments(ModelArguments, DataArguments, LoraArguments, MetricsArguments, TrainingArguments):
    """Everything one job needs: model and data fields plus every TrainingArguments flag.

    The TrainingArguments fields redeclared below with default None are filled from AUTO_DEFAULTS, by the
    kind of job (built-in, from scratch, pretrained); a value you set always wins.
    """

    overwrite_output_dir: bool = field(
        default=False,
        metadata=_help("Start over in --output_dir even if it holds another run (its checkpoints are deleted)."),
    )
    output_dir: str | None = field(
        default=None,
        metadata=_help(
            "Where checkpoints and the final model go. Default: outputs/default for the built-in "
            "job (outputs/default-causal-lm for its causal-lm form), else trainer_output."
        ),
    )
    num_train_epochs: float | None = field(
        default=None,
        metadata=_help(
            "Epochs to train (ignored when --max_steps > 0). Default: 10 for the built-in causal-lm job, else 3."
        ),
    )
    learning_rate: float | None = field(
        default=None, metadata=_help("Peak learning rate. Default: 2e-3 for a model from scratch, else 5e-5.")
    )
    per_device_train_batch_size: int | None = field(
        default=None, metadata=_help("Training batch per device. Default: 32 for a model from scratch, else 8.")
    )
    per_device_eval_batch_size: int | None = field(
        default=None, metadata=_help("Evaluation batch per device. Default: 64 for a model from scratch, else 8.")
    )
    logging_steps: float | None = field(
        default=None, metadata=_help("Log every N steps (a float < 1 is a ratio). Default: 25 from scratch, else 500.")
    )
    save_strategy: str | None = field(
        default=None,
        metadata=_help(
            "When to save checkpoints: no, steps, epoch or best. Default: no for the built-in job "
            "(it takes seconds), else steps."
        ),
    )

    save_final_model: bool = field(
        default=True,
        metadata=_help("Write the final model, config and tokenizer to --output_dir and check they reload."),
    )
    run_summary: bool = field(default=True, metadata=_help("Print what one optimizer step means at the start."))
    exact_eval_loss: bool = field(
        default=True,
        metadata=_help(
            "eval_loss as the exact mean over tokens (or samples) of the whole eval set, the same on any number of "
            "processes and batch size; transformers' mean of batch means is logged as eval_batch_mean_loss."
        ),
    )
    save_on_preemption: bool = field(
        default=True,
        metadata=_help("On SIGTERM/SIGUSR1: save a checkpoint at the next step, exit with --preemption_exit_code."),
    )
    report_plots: bool = field(
        default=True,
        metadata=_help(
            "Write curves and a summary to --output_dir/report (report.html) at checkpoints and at the end."
        ),
    )
    device_memory: str | None = field(
        default=None,
        metadata=_help(
            "Memory of one device, such as 80GiB: the start-up block warns when the memory estimate exceeds it "
            "and names the flags that would make it fit. Default: the GPU's own memory (no limit on CPU)."
        ),
    )

    def __post_init__(self) -> None:
        # every value's shape first: a list or mapping where a number goes must not reach anything below
        check_field_types(self, also=LOOSER_TYPES)
        self.validate_ranges()
        self.validate_model()
        self.validate_data()
        self.validate_lora()
        self.validate_metrics()
        if self.lora_r:
            self._fill(lora_alpha=LORA_ALPHA_PER_RANK * self.lora_r, lora_dropout=LORA_DROPOUT)
        builtin = not (self.model_name_or_path or self.model_config or self.dataset_name or self.train_file)
        if self.from_scratch and self.model_config is None:
            self.model_config = DEFAULT_PRESET[self.task]
        if not (self.train_file or self.dataset_name):
            self.train_file = str(SHIPPED_DATA[self.task])
            self.text_column = self.text_column or "text"
            if self.task == "sequence-classification":
                self.label_column = self.label_column or "label"
        layers = ["scratch" if self.from_scratch else "pretrained", "any"]
        if builtin:
            name = "default" if self.task == "sequence-classification" else f"default-{self.task}"
            self._fill(output_dir=f"outputs/{name}")
            layers[:0] = ["builtin", f"builtin-{self.task}"]
        for layer in layers:
            self._fill(**AUTO_DEFAULTS.get(layer, {}))
        super().__post_init__()

    def _fill(self, **values: Any) -> None:
        """Set the fields still None to ``values``; remember them in ``auto_filled`` for the log."""
        if not hasattr(self, "auto_filled"):
            self.auto_filled: dict[str, Any] = {}
        for name, value in values.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
                self.auto_filled[name] = value

    def validate_ranges(self) -> None:
        """Values of the right type that still mean nothing (a run of -125 steps, a save every -3 steps).

        None is a value still to be filled by the job's automatic defaults.
        """
        steps, epochs = self.max_steps, self.num_train_epochs
        if steps is not None and steps < -1:
            raise ConfigError(f"--max_steps must be -1 (train --num_train_epochs) or more than 0, got {steps}")
        if epochs is not None and epochs < 0:
            raise ConfigError(f"--num_train_epochs must not be negative, got {epochs}")
        if steps is not None and epochs is not None and steps <= 0 and epochs <= 0:
            raise ConfigError(
                f"nothing to train: --max_steps {steps} and --num_train_epochs {epochs}; set --max_steps to a "
                "number of optimizer steps, or --num_train_epochs to more than 0"
            )
        for flag in ("save_steps", "eval_steps", "logging_steps"):
            value = getattr(self, flag)
            if value is not None and value <= 0:
                raise ConfigError(
                    f"--{flag} must be more than 0 (a number of steps, or below 1 a fraction of the run), got {value}"
                )
        if not 2 <= self.max_seq_length <= MAX_SEQ_LENGTH:
            raise ConfigError(
                f"--max_seq_length must be between 2 and {MAX_SEQ_LENGTH} tokens, got {self.max_seq_length}"
            )
        if self.device_memory is not None and parse_size(self.device_memory, "--device_memory") <= 0:
            raise ConfigError(f"--device_memory must be more than 0 bytes, got {self.device_memory!r}")

    def fingerprint(self) -> dict[str, Any]:
        """The fields that identify a job's model and data: two runs with equal fingerprints are the same job.

        A LoRA job adds its rank and target modules (what its checkpoints hold); a full fine-tune has neither key, so
        runs recorded before LoRA flags existed keep their fingerprint.
        """
        keys = (
            "task",
            "model_name_or_path",
            "model_config",
            "tokenizer_name",
            "dataset_name",
            "dataset_config_name",
            "train_file",
            "validation_file",
            "text_column",
            "label_column",
        )
        values = {key: getattr(self, key) for key in keys}
        for key in ("train_file", "validation_file", "model_config"):
            if values[key] and os.path.exists(values[key]):
                values[key] = os.path.abspath(values[key])
        if self.lora_r:
            values.update(lora_r=self.lora_r, lora_target_modules=self.lora_target_modules)
        return values


def field_names(cls: type = TrainJobArguments) -> list[str]:
    """Every settable field of ``cls``, i.e. every valid flag and config key."""
    return [f.name for f in fields(cls) if f.init]


def job_arguments_from_dict(values: Mapping[str, Any]) -> TrainJobArguments:
    """Build TrainJobArguments from a mapping of field names (dashes allowed), rejecting unknown keys."""
    return TrainJobArguments(**normalize_keys(values, field_names(), "the arguments"))
