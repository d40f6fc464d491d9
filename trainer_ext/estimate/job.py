"""From ``trainer-ext train`` flags to the model's shape and the job's setup, the model built on the meta device.

The flags are read by the train job's own parser; the strategy and precision flags are read here without building
their backends (an fp16 or FSDP job is estimated on a one-process CPU machine), everything else is validated by
TrainJobArguments as ``train`` would. The model is built exactly as ``train`` builds it (tokenizer from the data,
vocabulary size from the tokenizer) under ``torch.device("meta")``: no weights are allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, closest
from .setup import Setup, setup_from_values
from .shape import ModelShape

# read here, not by TrainingArguments: they would check this machine (fp16 needs CUDA, FSDP needs 2 processes)
TARGET_FLAGS = ("fsdp", "fsdp_config", "deepspeed", "fp16", "bf16", "fp8")
LENGTH_SAMPLE = 10_000  # examples tokenized to find a classifier's longest sequence


@dataclass(frozen=True)
class Job:
    """A job to estimate: its shape, setup and the validated arguments (strategy/precision flags left out)."""

    shape: ModelShape
    setup: Setup
    args: Any


def _parse(argv: Sequence[str]) -> tuple[dict[str, Any], Any]:
    from ..arguments import TrainJobArguments
    from ..flags import parse_train_values

    values, extras, parser = parse_train_values(argv)
    if extras:
        given = next((w for w in extras if w.startswith("-")), extras[0]).split("=", 1)[0]
        valid = sorted({s.lstrip("-") for a in parser._actions for s in a.option_strings} | ESTIMATE_FLAGS)
        hint = closest(given.lstrip("-").replace("-", "_"), valid)
        suggestion = " Did you mean " + " or ".join(f"--{m}" for m in hint) + "?" if hint else ""
        raise ConfigError(f"unknown flag {given}.{suggestion} (all flags: trainer-ext estimate --help)")
    built = dict(values)
    for name in TARGET_FLAGS:
        built[name] = parser.get_default(name)
    return values, TrainJobArguments(**built)


ESTIMATE_FLAGS = {"num_processes", "device_memory", "measure", "json"}


def sequence_length(args: Any, tokenized_lengths: Sequence[int] | None) -> int:
    """Tokens per sequence: the block size of a causal LM, the longest example of a classifier (padded per batch)."""
    if args.task == "causal-lm" or not tokenized_lengths:
        return args.max_seq_length
    return min(args.max_seq_length, max(tokenized_lengths))


def build_meta_model(args: Any) -> tuple[torch.nn.Module, int]:
    """The job's model on the meta device, and its sequence length; ConfigError on unreadable data or config."""
    import transformers

    from ..api import build_model, build_tokenizer, label_names, load_raw_datasets, resolve_columns

    raw = load_raw_datasets(args)
    text_column, label_column = resolve_columns(args, raw)
    labels = label_names(args, raw, label_column) if label_column else None
    tokenizer = build_tokenizer(args, raw["train"][text_column])
    lengths = None
    if labels:
        texts = list(raw["train"].select(range(min(len(raw["train"]), LENGTH_SAMPLE)))[text_column])
        lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=args.max_seq_length)["input_ids"]]
    with torch.device("meta"):
        if args.model_name_or_path:  # the config only: weights are never read
            auto = transformers.AutoModelForSequenceClassification if labels else transformers.AutoModelForCausalLM
            config = transformers.AutoConfig.from_pretrained(
                args.model_name_or_path, trust_remote_code=args.trust_remote_code
            )
            if labels:
                config.num_labels = len(labels)
            model = auto.from_config(config, trust_remote_code=args.trust_remote_code)
        else:
            model = build_model(args, tokenizer, labels)
    return model, sequence_length(args, lengths)


def job_from_argv(argv: Sequence[str], num_processes: int) -> Job:
    """Parse train flags, build the meta model, read the setup for ``num_processes`` ranks."""
    if num_processes < 1:
        raise ConfigError(f"--num_processes must be at least 1, got {num_processes}")
    values, args = _parse(argv)
    model, seq_len = build_meta_model(args)
    filled = {
        **values,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "optim": getattr(args.optim, "value", args.optim),
    }
    return Job(ModelShape.from_model(model), setup_from_values(filled, num_processes, seq_len), args)
