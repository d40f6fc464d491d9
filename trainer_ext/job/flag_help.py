"""``trainer-ext train --help``: the flags in groups a person reads top down, each flag with one default.

The job's own flags (model, data, task) come first, then training, evaluation, saving, precision and distribution,
logging; the rest of transformers' TrainingArguments is listed only by ``--help_all``.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

from trainer_ext.job.flag_spec import Flag

HELP_ALL = "--help_all"
USAGE = "usage: trainer-ext train [--config FILE] [--flag VALUE ...]"
DESCRIPTION = (
    "Fine-tune or train a model. With no flags: the built-in job (a small classifier trained on data shipped with "
    "trainer_ext). Flags override --config files; --a-b is the same as --a_b; a boolean flag alone means true."
)

# (title, the flags in it); every flag of no group is listed by --help_all only
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (title, tuple(names.split()))
    for title, names in (
        (
            "the job: task, model, data",
            "config task model_name_or_path model_config tokenizer_name num_labels trust_remote_code train_file "
            "validation_file dataset_name dataset_config_name validation_split_percentage text_column "
            "label_column max_seq_length max_train_samples max_eval_samples output_dir overwrite_output_dir",
        ),
        (
            "chat jobs: --task sft and dpo",
            "data_format column_mapping chat_template assistant_only_loss packing chat_truncation beta loss_type "
            "reference_free simpo_gamma ref_model_name_or_path",
        ),
        (
            "LoRA (needs the peft extra)",
            "lora_r lora_alpha lora_dropout lora_target_modules merge_lora",
        ),
        (
            "training",
            "num_train_epochs max_steps per_device_train_batch_size gradient_accumulation_steps "
            "auto_find_batch_size learning_rate lr_scheduler_type lr_scheduler_kwargs warmup_steps optim "
            "optim_args weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm label_smoothing_factor seed "
            "data_seed gradient_checkpointing gradient_checkpointing_kwargs",
        ),
        (
            "evaluation",
            "eval_strategy eval_steps eval_delay eval_on_start per_device_eval_batch_size metrics metrics_average "
            "exact_eval_loss load_best_model_at_end metric_for_best_model greater_is_better prediction_loss_only",
        ),
        (
            "saving and resuming",
            "save_strategy save_steps save_total_limit save_only_model save_final_model resume_from_checkpoint "
            "save_on_preemption preemption_exit_code ignore_data_skip",
        ),
        (
            "precision and distribution",
            "bf16 fp16 fp8 tf32 use_cpu parallelism fsdp fsdp_config deepspeed device_memory ddp_backend ddp_timeout "
            "ddp_find_unused_parameters torch_compile",
        ),
        (
            "logging and reports",
            "logging_steps logging_strategy logging_first_step report_to run_name report_plots run_summary "
            "log_level disable_tqdm",
        ),
    )
)
REST = "more of transformers' TrainingArguments"


def _metavar(flag: Flag) -> str:
    if flag.choices and len(flag.choices) <= 6:
        return "{" + ",".join(flag.choices) + "}"
    return {"int": "N", "float": "X", "bool": "[BOOL]"}.get(flag.kind, "VALUE" if flag.dest != "config" else "FILE")


def _default_text(flag: Flag) -> str:
    """`` (default: X)`` unless the help already says its default or there is none to state."""
    if "default" in flag.help.lower() or flag.default in (None, "", []) or flag.dest == "config":
        return ""
    value = flag.default
    if isinstance(value, bool):
        value = str(value).lower()
    elif isinstance(value, list):
        value = " ".join(str(v) for v in value)
    return f" (default: {value})"


def _help_text(flag: Flag) -> str:
    text = flag.help or ""
    if flag.choices and len(flag.choices) > 6:
        text += f" One of: {', '.join(flag.choices)}."
    if flag.negative:
        text += f" {flag.negative[0]} turns it off."
    return text + _default_text(flag)


def _entry(flag: Flag, width: int) -> list[str]:
    head = f"  {flag.name} {_metavar(flag)}".rstrip()
    if flag.negative:
        head += f", {flag.negative[0]}"
    indent = " " * 26
    body = textwrap.wrap(_help_text(flag), width=max(width - len(indent), 30), break_on_hyphens=False) or [""]
    if len(head) < len(indent) - 1:
        lines = [head.ljust(len(indent)) + body[0]]
    else:
        lines = [head, indent + body[0]]
    return lines + [indent + line for line in body[1:]]


def render(flags: Sequence[Flag], everything: bool = False, width: int | None = None) -> str:
    """The help page: the grouped flags, and the others (``everything``) or a line saying how to see them."""
    width = width or min(shutil.get_terminal_size((100, 24)).columns, 119)
    by_dest = {flag.dest: flag for flag in flags}
    lines = [USAGE, "", *textwrap.wrap(DESCRIPTION, width=width)]
    shown: set[str] = set()
    for title, dests in GROUPS:
        present = [by_dest[d] for d in dests if d in by_dest]
        if not present:
            continue
        lines += ["", f"{title}:"]
        for flag in present:
            lines += _entry(flag, width)
            shown.add(flag.dest)
    rest = [flag for flag in flags if flag.dest not in shown]
    lines.append("")
    if everything:
        lines.append(f"{REST}:")
        for flag in rest:
            lines += _entry(flag, width)
    else:
        lines += textwrap.wrap(
            f"{len(rest)} {REST} (hub, dataloader, debugging, DDP details, ...) are not listed here: "
            f"trainer-ext train {HELP_ALL} shows every flag.",
            width=width,
        )
    lines += ["", "  -h, --help              this page", f"  {HELP_ALL:<24}every flag"]
    return "\n".join(lines) + "\n"
