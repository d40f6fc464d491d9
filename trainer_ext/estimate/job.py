"""From ``trainer-ext train`` flags to the model's shape and the job's setup, the model built on the meta device.

The flags are read by the train job's own parser; the strategy and precision flags are read here without building
their backends (an fp16 or FSDP job is estimated on a one-process CPU machine), everything else is validated by
TrainJobArguments as ``train`` would. The model is built exactly as ``train`` builds it (tokenizer from the data,
vocabulary size from the tokenizer) under ``torch.device("meta")``: no weights are allocated.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from trainer_ext.errors import ConfigError
from trainer_ext.estimate.lengths import sample_column, sequence_length
from trainer_ext.estimate.setup import Setup, setup_from_values
from trainer_ext.estimate.shape import ModelShape
from trainer_ext.job.fields import PRESETS
from trainer_ext.job.model_limits import check_job_config, check_model_config

# read here, not by TrainingArguments: they would check this machine (fp16 needs CUDA, FSDP needs a launcher)
TARGET_FLAGS = ("fsdp", "fsdp_config", "deepspeed", "fp16", "bf16", "fp8")
# the mesh's sizes: checked against --num_processes here, not against this one process by TrainingArguments
PARALLEL_FLAGS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "pp_size")
PARALLEL_OPTIONS = (*PARALLEL_FLAGS, "cp_backend", "pp_schedule", "pp_microbatches")
ESTIMATE_FLAGS = ("num_processes", "device_memory", "measure", "json")


@dataclass(frozen=True)
class Job:
    """A job to estimate: its shape, setup and the validated arguments (strategy/precision flags left out), and
    notes on what ``train`` changes of what was asked (a from-scratch config's vocabulary)."""

    shape: ModelShape
    setup: Setup
    args: Any
    notes: tuple[str, ...] = ()
    mesh: str = ""  # the parallel sizes' mesh, e.g. "dp_shard 2 x tp 2 (2 data-parallel ranks)"; "" without sizes
    model: Any = field(default=None, compare=False, repr=False)  # the meta-device model (the planner checks sizes)


def check_combinations(values: dict[str, Any], num_processes: int) -> None:
    """The rules ``train`` applies to the flags left out of TrainJobArguments here, except those about this
    machine's device (fp16 needing CUDA, bf16/fp8 support): --fsdp with --deepspeed, --fp16 with --bf16, --fp8 with
    either, the strategy's process count (the job is estimated as launched: FSDP on one process is allowed then),
    fsdp_config checks, --auto_find_batch_size with a sharding strategy."""
    from trainer_ext.distributed.rules import check_precision, check_world
    from trainer_ext.distributed.strategies.fsdp.config import fsdp_requested
    from trainer_ext.job.arguments import TrainJobArguments

    fp16, bf16 = bool(values.get("fp16")), bool(values.get("bf16"))
    if values.get("fp8") and (fp16 or bf16):
        raise ConfigError("--fp8 already runs bf16 autocast around its float8 layers; drop --fp16/--bf16")
    check_precision("no", torch.device("cpu"), fp16=fp16, bf16=bf16)  # "no": only the rule about the flags
    flags = SimpleNamespace(
        **{name: values.get(name) for name in ("deepspeed", "fsdp", "fsdp_config", "auto_find_batch_size")},
        activation_checkpointing=values.get("activation_checkpointing"),
        gradient_checkpointing=values.get("gradient_checkpointing"),
    )
    TrainJobArguments._refuse_combinations(flags)  # not whether deepspeed is installed: estimating needs none
    if fsdp_requested(flags.fsdp):
        check_world(num_processes, "fsdp")
        TrainJobArguments._process_fsdp_args(flags)  # fsdp_config keys and its checkpointing rule, as train reads them


def parse_job_flags(argv: Sequence[str], num_processes: int | None) -> tuple[dict[str, Any], Any]:
    """The flag values and the TrainJobArguments ``train`` would build, checked as launched on ``num_processes``
    ranks but not against this machine (strategy, precision and parallel flags are left out of the arguments; the
    parallel sizes are checked on their own, not against ``num_processes``)."""
    values, args, _, _ = _parse(argv, num_processes, fit=False)
    return values, args


def _parse(argv: Sequence[str], num_processes: int | None, fit: bool = True) -> tuple[dict[str, Any], Any, Any, int]:
    """:func:`parse_job_flags`, with the ``ParallelismConfig`` (or None) fitted to the number of processes (None:
    the sizes' product), and that number."""
    from trainer_ext.job.arguments import TrainJobArguments
    from trainer_ext.job.flags import _unknown_flag_error, parse_train_values

    values, extras, parser = parse_train_values(argv)
    if extras:
        raise _unknown_flag_error(extras, parser, command="estimate", more_flags=ESTIMATE_FLAGS)
    config, world = parallel_sizes(values, num_processes if fit else None)
    num_processes = world if fit or num_processes is None else num_processes
    check_combinations(values, num_processes)
    built = dict(values)
    for name in TARGET_FLAGS + PARALLEL_OPTIONS:
        built[name] = parser.get_default(name)
    return values, TrainJobArguments(**built), config, num_processes


def vocabulary_note(args: Any, tokenizer: Any) -> str | None:
    """What ``train`` does to a from-scratch config file's ``vocab_size`` (sizes it to the tokenizer), when that
    changes it; None otherwise (a preset names no vocabulary, a pretrained model keeps its own)."""
    from trainer_ext.job.run import model_config

    if args.model_name_or_path or not args.model_config or not os.path.exists(os.path.expanduser(args.model_config)):
        return None
    try:
        asked, used = getattr(model_config(args), "vocab_size", None), len(tokenizer)
    except (OSError, ValueError):
        return None  # an unreadable config: building the model says what is wrong with it
    if asked is None or asked == used:
        return None
    source = (
        f"the tokenizer {args.tokenizer_name!r}"
        if args.tokenizer_name
        else "the word-level tokenizer built from the training data"
    )
    return (
        f"vocab_size {asked:,} of --model_config {args.model_config} replaced by {used:,}, the size of {source}: "
        "train sizes a model from scratch to its tokenizer (--tokenizer_name chooses another)"
    )


def _config_source(args: Any) -> str:
    """How messages name a from-scratch config once sized to the tokenizer, the labels and --max_seq_length."""
    if args.model_config and args.model_config not in PRESETS:
        return f"--model_config {args.model_config} (as sized to the data)"
    return f"the preset {args.model_config or 'of --task'} (as sized to the data and --max_seq_length)"


def build_meta_model(args: Any) -> tuple[torch.nn.Module, int, list[str], int]:
    """The job's model on the meta device, its sequence length, notes (:func:`vocabulary_note`) and the bytes of a
    dpo job's reference model (:func:`reference_bytes`); ConfigError on unreadable data or config. An sft or dpo
    job's tokenizer is the chat job's (:func:`_chat_tokenizer`)."""
    import transformers

    from trainer_ext.job.chat_arguments import CHAT_TASKS
    from trainer_ext.job.run import build_model, build_tokenizer, label_names, load_raw_datasets, resolve_columns

    config = check_job_config(args)  # before the data is read or anything built
    raw = load_raw_datasets(args)  # a chat task's rows in their canonical form
    labels, lengths, notes = None, None, []
    if args.task in CHAT_TASKS:
        tokenizer, grown = _chat_tokenizer(args, raw["train"], config)
        notes += [grown] if grown else []
    else:
        text_column, label_column = resolve_columns(args, raw)
        labels = label_names(args, raw, label_column) if label_column else None
        tokenizer = build_tokenizer(args, raw["train"][text_column])
        if labels:
            texts = sample_column(raw["train"], text_column)
            tokens = tokenizer(texts, truncation=True, max_length=args.max_seq_length)["input_ids"]
            lengths = [len(ids) for ids in tokens]
    notes += [note] if (note := vocabulary_note(args, tokenizer)) else []
    with torch.device("meta"):
        if args.model_name_or_path:  # the config only: weights are never read
            auto = transformers.AutoModelForSequenceClassification if labels else transformers.AutoModelForCausalLM
            if labels:
                config.num_labels = len(labels)
            check_model_config(config, f"--model_name_or_path {args.model_name_or_path}")
            model = auto.from_config(config, trust_remote_code=args.trust_remote_code)
        else:
            model = build_model(args, tokenizer, labels)
            check_model_config(model.config, _config_source(args))  # sized to the tokenizer and the labels
        reference = reference_bytes(args, model) if args.task == "dpo" else 0
        if args.lora_r:  # as train: only the adapters (and a classifier head) train
            from trainer_ext.job.lora import apply_lora

            model = apply_lora(args, model)
    return model, sequence_length(args, lengths), notes, reference


def _chat_tokenizer(args: Any, train: Any, config: Any) -> tuple[Any, str | None]:
    """The sft/dpo job's tokenizer (``chat_job.build_chat_tokenizer``) and, when the template's tokens it adds grow
    a pretrained model's vocabulary (``train`` resizes the embeddings to the tokenizer), a note saying so; the
    config's vocabulary then grows with it (a smaller tokenizer, e.g. the one-word stand-ins of configs/estimate,
    leaves it as it is)."""
    from trainer_ext.job import chat_job

    quiet = logging.getLogger(chat_job.__name__)  # its warning about added tokens: the note below says what counts
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        tokenizer, _, added = chat_job.build_chat_tokenizer(args, train)
    finally:
        quiet.setLevel(level)
    vocab = getattr(config, "vocab_size", None) if config is not None else None
    if not added or not isinstance(vocab, int) or len(tokenizer) <= vocab:
        return tokenizer, None
    config.vocab_size = len(tokenizer)
    return tokenizer, (
        f"the chat template's tokens {', '.join(added)} are new to the tokenizer: train adds them and grows the "
        f"embeddings from {vocab:,} to {len(tokenizer):,} rows"
    )


def reference_bytes(args: Any, model: torch.nn.Module) -> int:
    """The weights' bytes of the frozen reference a dpo job holds beside ``model`` (the meta model before LoRA),
    as ``chat_job.reference_model`` makes it: a copy of the model, the config of ``--ref_model_name_or_path``
    in its own dtype, or none (LoRA, ``--reference_free``, ``--loss_type simpo``)."""
    import transformers

    from trainer_ext.estimate.shape import weight_bytes
    from trainer_ext.job.chat_job import reference_model

    if args.ref_model_name_or_path and not args.reference_free and args.loss_type != "simpo":
        path = args.ref_model_name_or_path
        try:
            config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
            check_model_config(config, f"--ref_model_name_or_path {path}")
            with torch.device("meta"):
                ref = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=args.trust_remote_code)
        except (OSError, ValueError) as error:
            reason = " ".join(str(error).split())[:300]
            raise ConfigError(f"could not read the config of --ref_model_name_or_path {path!r}: {reason}") from error
        return weight_bytes(ref)
    ref = reference_model(args, model)  # a meta copy: no memory
    return weight_bytes(ref) if ref is not None else 0


def parallel_sizes(values: dict[str, Any], num_processes: int | None) -> tuple[Any, int]:
    """The job's ``ParallelismConfig`` fitted to the processes (None without sizes) and the number of processes:
    ``num_processes`` when given, else the sizes' product. ConfigError as ``launch`` refuses: sizes that do not
    multiply to the processes, tensor or context parallelism with DeepSpeed."""
    from trainer_ext.job.parallel import fitted, parallelism_from_sizes

    config = parallelism_from_sizes(
        {name: values.get(name) for name in PARALLEL_FLAGS},
        values.get("cp_backend"),
        values.get("pp_schedule"),
        values.get("pp_microbatches"),
    )
    world = num_processes if num_processes is not None else (config.total_size if config else 1)
    if config is None:
        return None, world
    config = fitted(config, world)
    for name, what in (("tp_size", "tensor"), ("cp_size", "context"), ("pp_size", "pipeline")):
        size = getattr(config, name)
        if size > 1 and values.get("deepspeed"):
            raise ConfigError(
                f"--{name} {size} with --deepspeed: {what} parallelism runs on FSDP2 or alone; drop --deepspeed "
                f"(use --dp_shard_size to shard the rest) or set --{name} 1"
            )
    return config, world


def check_tp_model(model: torch.nn.Module, tp_size: int, source: str, vocab: bool = False) -> None:
    """The model's own plan and the sizes it splits, as training checks them before sharding (one line)."""
    from trainer_ext.distributed.mesh.tensor_parallel import model_tp_plan
    from trainer_ext.job.parallel import check_tp_config

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    values = {**config.to_dict(), "model_type": getattr(model.config, "model_type", None)}
    base = getattr(config, "base_model_tp_plan", None)
    plan = base if base or not model_tp_plan(model) else model_tp_plan(model)
    check_tp_config(values, plan, tp_size, source, vocab)


def check_pp_model(model: torch.nn.Module, config: Any) -> None:
    """The model against the pipeline's split rule, as training checks it before splitting (one line)."""
    from trainer_ext.distributed.pipeline.split import why_not
    from trainer_ext.job.parallel import pipeline_stages

    stages = pipeline_stages(config)
    reason = why_not(model, stages)
    if reason is not None:
        raise ConfigError(
            f"the model: pipeline of {stages} stages: {reason}; set --pp_size 1 (use --dp_shard_size), or estimate "
            "another model"
        )


def job_from_argv(argv: Sequence[str], num_processes: int | None = None) -> Job:
    """Parse train flags, build the meta model, read the setup for ``num_processes`` ranks (default: the product of
    the parallel sizes, else 1)."""
    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"--num_processes must be at least 1, got {num_processes}")
    values, args, config, num_processes = _parse(argv, num_processes)
    notes: list[str] = []
    if config is not None:
        from trainer_ext.job.parallel import check_cp_job

        args.tp_size = config.tp_size  # a vocabulary from scratch is padded for it, as train pads it
        from trainer_ext.job.parallel import check_pp_job

        notes += check_cp_job(vars(args), config.cp_size)  # the task, before the data is read
        check_pp_job(vars(args), config.pp_size)
    model, seq_len, built_notes, reference = build_meta_model(args)
    notes += built_notes
    if config is not None and config.tp_size > 1:
        check_tp_model(model, config.tp_size, "the model", vocab=bool(args.model_name_or_path))
    if config is not None and config.cp_size > 1:
        from trainer_ext.job.parallel import check_model_for_cp

        check_model_for_cp(model, config.cp_size, "the model")
    if config is not None and config.pp_size > 1:
        check_pp_model(model, config)
    filled = {
        **values,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "optim": getattr(args.optim, "value", args.optim),
        "optim_args": args.optim_args,
        **({name: getattr(config, name) for name in PARALLEL_OPTIONS} if config is not None else {}),
    }
    mesh = ""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the machine --measure runs on
    if config is not None:
        from trainer_ext.distributed.mesh.setup import describe as mesh_text
        from trainer_ext.job.parallel import data_parallel_ranks

        ranks = data_parallel_ranks(config)
        mesh = f"{mesh_text(config)} ({ranks} data-parallel rank{'s' * (ranks > 1)})"
        if config.cp_size > 1:
            from trainer_ext.estimate.setup import estimated_backend

            used = estimated_backend(config.cp_backend, device)
            mesh += f"; context-parallel attention {used}" + (
                f" ({config.cp_backend})" if used != config.cp_backend else ""
            )
    setup = setup_from_values(filled, num_processes, seq_len, device_type=device)
    shape = ModelShape.from_model(model)
    shape = dataclasses.replace(shape, reference_bytes=reference)
    if setup.pp_size > 1:
        from trainer_ext.estimate.pipeline import describe as pipeline_text

        mesh += f"; pipeline {pipeline_text(setup, shape)}"
    return Job(shape, setup, args, tuple(notes), mesh, model)
