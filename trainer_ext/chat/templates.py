"""Chat templates: the built-ins, choosing one (--chat_template), and the assistant-only mask of a conversation.

Each built-in renders system, user and assistant turns as its model family's own template does, and wraps each
assistant answer with its end-of-turn token in ``{% generation %}...{% endgeneration %}``, so transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks exactly those tokens (as TRL's SFTTrainer reads
them). A template without those markers is marked by rendering prefixes of the conversation, and refused when a
prefix does not render as the start of the whole conversation (a template that rewrites earlier turns).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer_ext.chat.names import TEMPLATE_NAMES
from trainer_ext.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHATML = r"""{%- for message in messages -%}
{%- if message['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}
{{- '\n' -}}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""

# Qwen2.5's template (without tools): chatml, a default system prompt, tool results as a user turn
QWEN = r"""{%- if messages[0]['role'] == 'system' -%}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) -%}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{%- elif message['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}
{{- '\n' -}}
{%- elif message['role'] == 'tool' -%}
{%- if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""

# Llama 3's template: headers, trimmed content, <|eot_id|>; tool results under Llama 3.1's ipython role
LLAMA_3 = r"""{%- for message in messages -%}
{%- if loop.first -%}{{- '<|begin_of_text|>' -}}{%- endif -%}
{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] -%}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' -}}
{%- if message['role'] == 'assistant' -%}
{%- generation -%}{{- message['content'] | trim + '<|eot_id|>' -}}{%- endgeneration -%}
{%- else -%}
{{- message['content'] | trim + '<|eot_id|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"""

# Mistral Instruct v0.2's template: the system message prepended to the first user turn, </s> after each answer
MISTRAL = r"""{%- if messages[0]['role'] == 'system' -%}
{%- set system_message = messages[0]['content'] -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{{- '<s>' -}}
{%- for message in loop_messages -%}
{%- if message['role'] == 'assistant' -%}
{{- ' ' -}}
{%- generation -%}{{- message['content'] + '</s>' -}}{%- endgeneration -%}
{%- elif message['role'] == 'tool' -%}
{{- ' [TOOL_RESULTS] ' + message['content'] + ' [/TOOL_RESULTS]' -}}
{%- elif loop.first and system_message is defined -%}
{{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' -}}
{%- else -%}
{{- ' [INST] ' + message['content'] + ' [/INST]' -}}
{%- endif -%}
{%- endfor -%}"""

BUILTIN_TEMPLATES = dict(zip(TEMPLATE_NAMES, (CHATML, LLAMA_3, MISTRAL, QWEN), strict=True))
TEMPLATE_TOKENS = {
    "chatml": ["<|im_start|>", "<|im_end|>"],
    "qwen": ["<|im_start|>", "<|im_end|>", "<tool_response>", "</tool_response>"],
    "llama-3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "mistral": ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
}
DEFAULT_TEMPLATE = "chatml"
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
CANNOT_MARK = "pass --chat_template with a built-in ({builtins}) or --assistant_only_loss false"


def has_generation_markers(template: str) -> bool:
    """Whether the template wraps assistant answers in ``{% generation %}`` (transformers' assistant mask)."""
    return bool(GENERATION_MARKER.search(template))


def resolve_template(tokenizer: PreTrainedTokenizerBase, name_or_path: str | None) -> str:
    """The template text: a built-in by name, a .jinja file, or (None) the tokenizer's own, else chatml."""
    if name_or_path is None:
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):
            own = own.get("default")
        return own if isinstance(own, str) and own.strip() else BUILTIN_TEMPLATES[DEFAULT_TEMPLATE]
    if name_or_path in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.suffix == ".jinja" or path.is_file():
        if not path.is_file():
            raise ConfigError(
                f"--chat_template file {name_or_path!r} does not exist; give a .jinja file or a built-in"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"could not read --chat_template {name_or_path!r}: {error}") from error
        if not text.strip():
            raise ConfigError(f"--chat_template file {name_or_path!r} is empty")
        return text
    raise ConfigError(
        f"--chat_template {name_or_path!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) nor a "
        f".jinja file.{did_you_mean(name_or_path, BUILTIN_TEMPLATES)}"
    )


def template_tokens(template_name: str | None) -> list[str]:
    """The special tokens a built-in template writes (None: chatml's, the default for a tokenizer without one).

    A word-level tokenizer built from scratch adds them as special tokens so each stays one token. A .jinja file's
    tokens are unknown here: [].
    """
    return list(TEMPLATE_TOKENS.get(DEFAULT_TEMPLATE if template_name is None else template_name, []))


def render_ids(tokenizer: PreTrainedTokenizerBase, messages: list, template: str | None, **kwargs: Any) -> list[int]:
    """The token ids of ``messages`` rendered by ``template`` (``None``: the tokenizer's own), ``kwargs`` going to
    ``apply_chat_template`` (``add_generation_prompt``), as TRL renders them; no messages render as no ids."""
    if not messages:
        return []
    return list(
        tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True, **kwargs)[
            "input_ids"
        ]
    )


def assistant_mask(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], template: str
) -> tuple[list[int], list[int]]:
    """(input_ids, mask) of the rendered conversation; mask 1 on the assistant answers and their end-of-turn token.

    With ``{% generation %}`` markers (and a fast tokenizer) the mask is transformers' assistant mask, token for token
    what TRL's SFTTrainer trains on. Without them, each assistant turn is the tokens between the conversation up to it
    (with the generation prompt) and the conversation through it, checked to be prefixes of the whole conversation.
    """
    if has_generation_markers(template) and getattr(tokenizer, "is_fast", False):
        out = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        return list(out["input_ids"]), list(out["assistant_masks"])
    ids = render_ids(tokenizer, messages, template)
    mask = [0] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_ids(tokenizer, messages[:index], template, add_generation_prompt=True)
        through = render_ids(tokenizer, messages[: index + 1], template)
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise ConfigError(
                f"the chat template cannot mark assistant turns: the conversation up to message {index} does not "
                "render as the start of the whole conversation (the template rewrites earlier turns); "
                + CANNOT_MARK.format(builtins=", ".join(BUILTIN_TEMPLATES))
            )
        mask[len(before) : len(through)] = [1] * (len(through) - len(before))
    return ids, mask
