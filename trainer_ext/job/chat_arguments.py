"""The flags of the chat jobs (``--task sft``, ``--task dpo``): data format, chat template, packing, preference loss.

Checked here, before torch or the data are read; the data-dependent checks (columns, rows, templates) run in
``trainer_ext.job.chat_job``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trainer_ext.chat.formats import parse_column_mapping
from trainer_ext.chat.names import FORMATS, LOSS_TYPES, TEMPLATE_NAMES, TRUNCATIONS
from trainer_ext.errors import ConfigError, did_you_mean
from trainer_ext.job.fields import field_help

CHAT_TASKS = ("sft", "dpo")
DATA_FORMATS = ("auto", *FORMATS)
# the dpo-only flags and their defaults: another value given to another task is a mistake worth one line
PREFERENCE_DEFAULTS = {
    "beta": 0.1,
    "loss_type": "sigmoid",
    "reference_free": False,
    "simpo_gamma": 0.5,
    "ref_model_name_or_path": None,
}
# the chat fields that decide what a checkpoint was trained on: a resume with other values is another job
CHAT_FINGERPRINT = (
    "data_format",
    "column_mapping",
    "chat_template",
    "assistant_only_loss",
    "packing",
    "chat_truncation",
    "loss_type",
    "reference_free",
    "ref_model_name_or_path",
)


@dataclass
class ChatArguments:
    """Chat supervised fine-tuning and preference training from local chat, instruction or preference data."""

    data_format: str = field(
        default="auto",
        metadata={
            **field_help(
                "sft/dpo data format: messages (role/content lists; ShareGPT conversations with from/value too), "
                "prompt-completion, alpaca (instruction/input/output), text (continued pre-training) or preference "
                "(prompt/chosen/rejected). auto: told by the columns."
            ),
            "choices": list(DATA_FORMATS),
        },
    )
    column_mapping: str | None = field(
        default=None,
        metadata=field_help(
            "sft/dpo: the data's own column names for the format's columns, as name=column pairs, comma-separated, "
            "e.g. prompt=question,completion=answer or messages=conversations."
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=field_help(
            f"sft/dpo: the chat template: a built-in ({', '.join(TEMPLATE_NAMES)}) or a .jinja file. "
            "Default: the tokenizer's own, else chatml."
        ),
    )
    assistant_only_loss: bool = field(
        default=True,
        metadata=field_help(
            "sft: train on the assistant turns (or the completion) only; the other tokens get label -100. false: on "
            "every token."
        ),
    )
    packing: bool = field(
        default=False,
        metadata=field_help(
            "sft: pack examples into blocks of --max_seq_length tokens; documents never attend to each other "
            "(position_ids restart at 0 for each, a block-causal mask)."
        ),
    )
    chat_truncation: str = field(
        default="turns",
        metadata={
            **field_help(
                "sft: a conversation longer than --max_seq_length: turns (keep its first whole turns, up to an "
                "assistant turn), drop (leave it out), error (stop, naming it) or cut (cut it at the limit). Each "
                "run says how many it touched."
            ),
            "choices": list(TRUNCATIONS),
        },
    )
    beta: float = field(
        default=PREFERENCE_DEFAULTS["beta"],
        metadata=field_help("dpo: how far the policy may move from the reference (higher: closer). Default: 0.1."),
    )
    loss_type: str = field(
        default=PREFERENCE_DEFAULTS["loss_type"],
        metadata={
            **field_help(
                "dpo: sigmoid (DPO), ipo (IPO) or simpo (SimPO: reference-free, length-normalised, with "
                "--simpo_gamma)."
            ),
            "choices": list(LOSS_TYPES),
        },
    )
    reference_free: bool = field(
        default=False,
        metadata=field_help("dpo: no reference model (its log-probabilities taken as 0): half the forward passes."),
    )
    simpo_gamma: float = field(
        default=PREFERENCE_DEFAULTS["simpo_gamma"],
        metadata=field_help("dpo with --loss_type simpo: the target reward margin. Default: 0.5."),
    )
    ref_model_name_or_path: str | None = field(
        default=None,
        metadata=field_help(
            "dpo: the reference model (a directory or hub id). Default: a frozen copy of the initial model; with "
            "--lora_r, the model with its adapters switched off."
        ),
    )

    def validate_chat(self) -> None:
        """Check the chat flags against the task (already normalised); raise ConfigError on bad input."""
        chat = self.task in CHAT_TASKS
        self.data_format = _choice("data_format", self.data_format, DATA_FORMATS)
        self.chat_truncation = _choice("chat_truncation", self.chat_truncation, TRUNCATIONS)
        self.loss_type = _choice("loss_type", self.loss_type, LOSS_TYPES)
        preference = [name for name, default in PREFERENCE_DEFAULTS.items() if getattr(self, name) != default]
        if preference and self.task != "dpo":
            raise ConfigError(f"--{preference[0]} applies to --task dpo, not {self.task}; pass --task dpo, or drop it")
        if not chat:
            if self.packing:
                raise ConfigError(f"--packing applies to --task sft, not {self.task}; pass --task sft, or drop it")
            given = [f for f in ("column_mapping", "chat_template") if getattr(self, f)]
            given += ["data_format"] * (self.data_format != "auto")
            given += ["assistant_only_loss"] * (not self.assistant_only_loss)
            given += ["chat_truncation"] * (self.chat_truncation != "turns")
            if given:
                raise ConfigError(
                    f"--{given[0]} applies to --task sft or dpo, not {self.task}; pass --task sft (or dpo), or drop it"
                )
            return
        text_flags = [
            flag for flag in ("text_column", "label_column", "num_labels") if getattr(self, flag) is not None
        ]
        if text_flags:
            raise ConfigError(
                f"--{text_flags[0]} applies to sequence-classification and causal-lm; an {self.task} job reads its "
                "columns by format: name yours with --column_mapping (e.g. --column_mapping prompt=question)"
            )
        if self.task == "dpo" and not self.assistant_only_loss:
            raise ConfigError("--assistant_only_loss applies to --task sft; dpo scores the responses only: drop it")
        if self.task == "dpo" and self.label_smoothing_factor:
            raise ConfigError(
                "--label_smoothing_factor applies to token losses, not to dpo's preference loss: drop it"
            )
        if self.simpo_gamma != PREFERENCE_DEFAULTS["simpo_gamma"] and self.loss_type != "simpo":
            raise ConfigError(f"--simpo_gamma applies to --loss_type simpo, not {self.loss_type}: drop it")
        parse_column_mapping(self.column_mapping)  # a malformed mapping: one line before any data is read
        if self.task == "dpo" and self.data_format not in ("auto", "preference"):
            raise ConfigError(
                f"--task dpo trains on preference pairs (prompt/chosen/rejected), not --data_format "
                f"{self.data_format}; pass --data_format preference or auto"
            )
        if self.task == "sft" and self.data_format == "preference":
            raise ConfigError(
                "--data_format preference is for --task dpo; for sft pass messages, prompt-completion, alpaca or text"
            )
        if self.task == "dpo" and self.packing:
            raise ConfigError("--packing applies to --task sft; drop it for dpo")
        if self.task == "dpo" and self.chat_truncation != "turns":
            raise ConfigError(
                "--chat_truncation applies to --task sft; dpo keeps each pair's prompt and cuts its answers at "
                "--max_seq_length (saying how many): drop it"
            )
        if self.beta <= 0:
            raise ConfigError(f"--beta must be more than 0, got {self.beta}")
        template = self.chat_template
        if template and template not in TEMPLATE_NAMES:
            if template.endswith((".jinja", ".j2")) or os.sep in template:
                if not os.path.isfile(os.path.expanduser(template)):
                    raise ConfigError(f"--chat_template {template!r}: no such file. Check the path.")
            else:
                raise ConfigError(
                    f"--chat_template {template!r} is neither a built-in template ({', '.join(TEMPLATE_NAMES)}) "
                    f"nor a .jinja file.{did_you_mean(template, TEMPLATE_NAMES)}"
                )
        if self.loss_type == "simpo" and self.ref_model_name_or_path:
            raise ConfigError("--loss_type simpo uses no reference model; drop --ref_model_name_or_path")
        if self.reference_free and self.ref_model_name_or_path:
            raise ConfigError("--reference_free and --ref_model_name_or_path both given: pass one")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> str:
    """``value`` normalised (lower case, dashes) if it is one of ``choices``, else one ConfigError line."""
    normal = str(value).strip().lower().replace("_", "-")
    if normal not in choices:
        raise ConfigError(f"--{flag} {value!r}: choose one of {', '.join(choices)}.{did_you_mean(normal, choices)}")
    return normal
