"""The arguments of one fine-tuning job: model and data fields plus every TrainingArguments flag.

``TrainJobArguments`` is the one object ``trainer_ext.train`` takes. Cheap checks (paths, extensions,
presets, flag combinations) run when it is built, so bad input fails before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from trainer_ext.distributed.mesh.config import CP_BACKENDS, PP_SCHEDULES
from trainer_ext.errors import ConfigError
from trainer_ext.field_types import check_field_types
from trainer_ext.job.chat_arguments import CHAT_FINGERPRINT, CHAT_TASKS, ChatArguments
from trainer_ext.job.fields import DATA_BUILDERS as DATA_BUILDERS
from trainer_ext.job.fields import DEFAULT_PRESET, SHIPPED_DATA, DataArguments, ModelArguments, field_help
from trainer_ext.job.fields import PRESETS as PRESETS
from trainer_ext.job.fields import TASKS as TASKS
from trainer_ext.job.fields import data_builder as data_builder
from trainer_ext.job.fields import looks_local as looks_local
from trainer_ext.job.lora_arguments import LORA_ALPHA_PER_RANK, LORA_DROPOUT, LoraArguments
from trainer_ext.job.metrics_arguments import MetricsArguments
from trainer_ext.trainer.training_args import TrainingArguments
from trainer_ext.values import normalize_keys, parse_size

MAX_SEQ_LENGTH = 1 << 20  # tokens: a from-scratch model's position table is sized from it
# values the Trainer takes besides what the field's annotation says (a config file may write them so)
LOOSER_TYPES: dict[str, tuple[type, ...]] = {
    "fsdp": (bool, list),
    "resume_from_checkpoint": (bool,),
    "debug": (type(None),),  # HfArgumentParser's own default for it
}

# Values for TrainingArguments fields left unset (None), most specific layer first: the built-in job saves no
# checkpoints (it takes seconds); small models from scratch want larger steps and batches than fine-tuning a
# pretrained model, where transformers' own defaults apply. Every parameter of a preset model gets a gradient in
# every step (tests/test_ddp_unused_parameters.py), so DDP need not search for unused ones (nor warn that it did).
AUTO_DEFAULTS: dict[str, dict[str, Any]] = {
    "preset": dict(ddp_find_unused_parameters=False),
    "builtin": dict(save_strategy="no"),
    "builtin-causal-lm": dict(num_train_epochs=10.0),
    "builtin-sft": dict(num_train_epochs=10.0),
    "builtin-dpo": dict(num_train_epochs=3.0, learning_rate=5e-4),
    "scratch": dict(
        learning_rate=2e-3, per_device_train_batch_size=32, per_device_eval_batch_size=64, logging_steps=25
    ),
    "pretrained": dict(
        learning_rate=5e-5, per_device_train_batch_size=8, per_device_eval_batch_size=8, logging_steps=500
    ),
    "any": dict(save_strategy="steps", num_train_epochs=3.0),
}


@dataclass
class TrainJobArguments(
    ModelArguments, DataArguments, ChatArguments, LoraArguments, MetricsArguments, TrainingArguments
):
    """Everything one job needs: model and data fields plus every TrainingArguments flag.

    The TrainingArguments fields redeclared below with default None are filled from AUTO_DEFAULTS, by the
    kind of job (built-in, from scratch, pretrained); a value you set always wins.
    """

    overwrite_output_dir: bool = field(
        default=False,
        metadata=field_help("Start over in --output_dir even if it holds another run (its checkpoints are deleted)."),
    )
    output_dir: str | None = field(
        default=None,
        metadata=field_help(
            "Where checkpoints and the final model go. Default: outputs/default for the built-in "
            "job (outputs/default-causal-lm for its causal-lm form), else trainer_output."
        ),
    )
    num_train_epochs: float | None = field(
        default=None,
        metadata=field_help(
            "Epochs to train (ignored when --max_steps > 0). Default: 10 for the built-in causal-lm job, else 3."
        ),
    )
    learning_rate: float | None = field(
        default=None, metadata=field_help("Peak learning rate. Default: 2e-3 for a model from scratch, else 5e-5.")
    )
    per_device_train_batch_size: int | None = field(
        default=None, metadata=field_help("Training batch per device. Default: 32 for a model from scratch, else 8.")
    )
    per_device_eval_batch_size: int | None = field(
        default=None, metadata=field_help("Evaluation batch per device. Default: 64 for a model from scratch, else 8.")
    )
    logging_steps: float | None = field(
        default=None,
        metadata=field_help("Log every N steps (a float < 1 is a ratio). Default: 25 from scratch, else 500."),
    )
    save_strategy: str | None = field(
        default=None,
        metadata=field_help(
            "When to save checkpoints: no, steps, epoch or best. Default: no for the built-in job "
            "(it takes seconds), else steps."
        ),
    )

    save_final_model: bool = field(
        default=True,
        metadata=field_help("Write the final model, config and tokenizer to --output_dir and check they reload."),
    )
    run_summary: bool = field(default=True, metadata=field_help("Print what one optimizer step means at the start."))
    exact_eval_loss: bool = field(
        default=True,
        metadata=field_help(
            "eval_loss as the exact mean over tokens (or samples) of the whole eval set, the same on any number of "
            "processes and batch size; transformers' mean of batch means is logged as eval_batch_mean_loss."
        ),
    )
    save_on_preemption: bool = field(
        default=True,
        metadata=field_help(
            "On SIGTERM/SIGUSR1: save a checkpoint at the next step, exit with --preemption_exit_code."
        ),
    )
    report_plots: bool = field(
        default=True,
        metadata=field_help(
            "Write curves and a summary to --output_dir/report (report.html) at checkpoints and at the end."
        ),
    )
    device_memory: str | None = field(
        default=None,
        metadata=field_help(
            "Memory of one device, such as 80GiB: the start-up block warns when the memory estimate exceeds it "
            "and names the flags that would make it fit. Default: the GPU's own memory (no limit on CPU)."
        ),
    )

    parallelism: str | None = field(
        default=None,
        metadata={
            **field_help(
                "auto: the trainer-ext CLI (train, or launch ... train) sets the layout before any process starts, "
                "to `trainer-ext plan`'s first choice for the run's processes, machines and device memory: FSDP, "
                "DeepSpeed or the mesh sizes, the micro-batch and accumulation (the global batch kept) and activation "
                "checkpointing; layout flags given with it fix that part. manual: the layout flags as given. "
                "Default: manual."
            ),
            "choices": ["manual", "auto"],
        },
    )
    dp_replicate_size: int | None = field(
        default=None,
        metadata=field_help(
            "Number of model replicas (data parallel). With --dp_shard_size > 1 too: HSDP, each replica sharded "
            "over dp_shard_size processes. Default: 1."
        ),
    )
    dp_shard_size: int | None = field(
        default=None,
        metadata=field_help(
            "Number of processes FSDP2 shards the model, gradients and optimizer states over (data parallel). "
            "Default: 1."
        ),
    )
    tp_size: int | None = field(
        default=None,
        metadata=field_help(
            "Number of processes for tensor parallelism: each layer's weights are split across them by the model's "
            "own plan (base_model_tp_plan), and they see the same batch. The sizes multiply to the number of "
            "processes. Default: 1."
        ),
    )
    cp_size: int | None = field(
        default=None,
        metadata=field_help(
            "Number of processes for context parallelism: each sequence is split over them (2 x cp_size chunks, "
            "load-balanced for causal attention), and they see the same batch; causal LMs with full attention only. "
            "Default: 1."
        ),
    )
    cp_backend: str | None = field(
        default=None,
        metadata={
            **field_help(
                "Context-parallel attention: auto (torch's ring attention on CUDA, all_gather elsewhere), torch "
                "(CUDA only) or all_gather (keys and values all-gathered; padding and packed documents exact). "
                "Default: auto."
            ),
            "choices": list(CP_BACKENDS),
        },
    )
    pp_size: int | None = field(
        default=None,
        metadata=field_help(
            "Number of pipeline stages' ranks (pipeline parallel): the decoder layers are split into consecutive "
            "stages balanced by parameter count, each rank runs its stages on microbatches of the batch; a multiple "
            "of it processes shards each stage over the rest (FSDP2). Causal LMs of llama, mistral, qwen2, qwen3 with "
            "untied embeddings only. Default: 1."
        ),
    )
    pp_schedule: str | None = field(
        default=None,
        metadata={
            **field_help(
                "Pipeline schedule: 1f1b, gpipe, interleaved_1f1b, looped_bfs, interleaved_zero_bubble or "
                "zbv_zero_bubble (the last four hold 2 stages per rank). Default: 1f1b."
            ),
            "choices": list(PP_SCHEDULES),
        },
    )
    pp_microbatches: int | None = field(
        default=None,
        metadata=field_help(
            "Microbatches each batch is split into for the pipeline (more shrink the idle bubble). Default: one per "
            "stage."
        ),
    )

    def __post_init__(self) -> None:
        # every value's shape first: a list or mapping where a number goes must not reach anything below
        check_field_types(self, also=LOOSER_TYPES)
        self.validate_ranges()
        self.validate_model()
        self.validate_data()
        self.validate_chat()
        self.validate_lora()
        self.validate_metrics()
        if self.lora_r:
            self._fill(lora_alpha=LORA_ALPHA_PER_RANK * self.lora_r, lora_dropout=LORA_DROPOUT)
        builtin = not (self.model_name_or_path or self.model_config or self.dataset_name or self.train_file)
        if self.from_scratch and self.model_config is None:
            self.model_config = DEFAULT_PRESET[self.task]
        if not (self.train_file or self.dataset_name):
            self.train_file = str(SHIPPED_DATA[self.task])
            if self.task in ("sequence-classification", "causal-lm"):
                self.text_column = self.text_column or "text"
            if self.task == "sequence-classification":
                self.label_column = self.label_column or "label"
        layers = ["scratch" if self.from_scratch else "pretrained", "any"]
        if builtin:
            name = "default" if self.task == "sequence-classification" else f"default-{self.task}"
            self._fill(output_dir=f"outputs/{name}")
            layers[:0] = ["builtin", f"builtin-{self.task}"]
        if self.from_scratch and self.model_config in PRESETS:
            layers.insert(0, "preset")
        for layer in layers:
            self._fill(**AUTO_DEFAULTS.get(layer, {}))
        self._set_parallelism()
        self._check_parallel_model()
        super().__post_init__()

    def _set_parallelism(self) -> None:
        """``parallelism_config`` from the size flags when any is above 1 (a bad size, cp_size > 1: one line)."""
        from trainer_ext.job.parallel import TRAIN_SIZES, parallelism_from_sizes

        sizes = {name: getattr(self, name) for name in TRAIN_SIZES}
        config = parallelism_from_sizes(sizes, self.cp_backend, self.pp_schedule, self.pp_microbatches)
        if config is None:
            return
        if self.parallelism_config is not None:
            given = ", ".join(f"{name}={value}" for name, value in sizes.items() if value is not None)
            raise ConfigError(
                f"both parallelism_config and {given} given: pass the sizes in one place (the flags make the config)"
            )
        self.parallelism_config = config

    def _check_parallel_model(self) -> None:
        """The model against tp_size, cp_size and pp_size before any process group, whether the sizes came from the
        flags, a ``parallelism_config`` object or the launcher's ``PARALLELISM_CONFIG_*`` variables (TrainingArguments
        reads those too)."""
        from trainer_ext.distributed.mesh.setup import as_parallelism_config
        from trainer_ext.job.parallel import check_job_model, pipeline_stages

        config = as_parallelism_config(self.parallelism_config)
        if config is not None:
            check_job_model(vars(self), config.tp_size, config.cp_size, pipeline_stages(config))

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
        if self.task in CHAT_TASKS:  # what the chat jobs' checkpoints were trained on
            values.update({key: getattr(self, key) for key in CHAT_FINGERPRINT})
            for key in ("chat_template", "ref_model_name_or_path"):
                if values[key] and os.path.exists(values[key]):
                    values[key] = os.path.abspath(values[key])
        return values


def field_names(cls: type = TrainJobArguments) -> list[str]:
    """Every settable field of ``cls``, i.e. every valid flag and config key."""
    return [f.name for f in fields(cls) if f.init]


def job_arguments_from_dict(values: Mapping[str, Any]) -> TrainJobArguments:
    """Build TrainJobArguments from a mapping of field names (dashes allowed), rejecting unknown keys."""
    return TrainJobArguments(**normalize_keys(values, field_names(), "the arguments"))
