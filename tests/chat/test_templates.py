"""Built-in chat templates render as their model families' templates, and mark exactly the assistant answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chat.tokenizer_kit import byte_bpe, word_level
from trainer_ext.chat.templates import (
    BUILTIN_TEMPLATES,
    GENERATION_MARKER,
    assistant_mask,
    has_generation_markers,
    resolve_template,
    template_tokens,
)
from trainer_ext.errors import ConfigError

S, U1, A1, U2, A2, U3, A3 = (
    "be brief",
    "what is two plus two",
    "four",
    "and three plus three",
    "six it is",
    "thanks",
    "you are welcome",
)
TWO_TURNS = [
    {"role": "system", "content": S},
    {"role": "user", "content": U1},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": U2},
    {"role": "assistant", "content": A2},
]
THREE_TURNS = [*TWO_TURNS, {"role": "tool", "content": "lookup done"}, {"role": "user", "content": U3}]
THREE_TURNS.append({"role": "assistant", "content": A3})
ANSWERS = [A1, A2, A3]
END_OF_TURN = {"chatml": "<|im_end|>", "qwen": "<|im_end|>", "llama-3": "<|eot_id|>", "mistral": "</s>"}
# written out by hand from each family's own template (Qwen2.5, Llama 3, Mistral Instruct v0.2)
EXPECTED = {
    "chatml": (
        f"<|im_start|>system\n{S}<|im_end|>\n<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n{A1}<|im_end|>\n"
        f"<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n{A2}<|im_end|>\n"
    ),
    "llama-3": (
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{S}<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{U1}<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n{A1}<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{U2}<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n{A2}<|eot_id|>"
    ),
    "mistral": f"<s> [INST] {S}\n\n{U1} [/INST] {A1}</s> [INST] {U2} [/INST] {A2}</s>",
}
EXPECTED["qwen"] = EXPECTED["chatml"]
GENERATION_PROMPT = {
    "chatml": "<|im_start|>assistant\n",
    "qwen": "<|im_start|>assistant\n",
    "llama-3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "",
}
TEXTS = [
    S,
    U1,
    A1,
    U2,
    A2,
    U3,
    A3,
    "lookup done",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
]


def _without_markers(template: str) -> str:
    stripped = GENERATION_MARKER.sub("", template).replace("{%- endgeneration -%}", "")
    assert not has_generation_markers(stripped) and "endgeneration" not in stripped
    return stripped


def _render(name: str, messages: list, **kwargs) -> str:
    tokenizer = word_level(TEXTS, name)
    return tokenizer.apply_chat_template(messages, chat_template=BUILTIN_TEMPLATES[name], tokenize=False, **kwargs)


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_rendering_matches_the_family_template(name: str) -> None:
    assert _render(name, TWO_TURNS) == EXPECTED[name]
    prompt = _render(name, TWO_TURNS[:4], add_generation_prompt=True)
    assert EXPECTED[name].startswith(prompt) and prompt.endswith(GENERATION_PROMPT[name])


def test_qwen_default_system_prompt_and_tool_turns() -> None:
    text = _render("qwen", TWO_TURNS[1:3])
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n{A1}<|im_end|>\n"
    )
    tools = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    text = _render("qwen", [*TWO_TURNS[:3], *tools])
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response><|im_end|>\n"
    )
    assert _render("chatml", [*TWO_TURNS[:3], tools[0]]).endswith("<|im_start|>tool\na<|im_end|>\n")
    assert _render("llama-3", [*TWO_TURNS[:3], tools[0]]).endswith(
        "<|start_header_id|>ipython<|end_header_id|>\n\na<|eot_id|>"
    )
    assert _render("mistral", [*TWO_TURNS[:3], tools[0]]).endswith(f"{A1}</s> [TOOL_RESULTS] a [/TOOL_RESULTS]")
    assert _render("mistral", TWO_TURNS[1:3]) == f"<s> [INST] {U1} [/INST] {A1}</s>"


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.parametrize("markers", [True, False], ids=["generation-markers", "prefix-renders"])
@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_word_level_mask_is_the_answers_and_their_end_of_turn(name: str, markers: bool) -> None:
    tokenizer = word_level(TEXTS, name)
    template = BUILTIN_TEMPLATES[name] if markers else _without_markers(BUILTIN_TEMPLATES[name])
    assert has_generation_markers(template) == markers
    ids, mask = assistant_mask(tokenizer, THREE_TURNS, template)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    rendered = tokenizer.apply_chat_template(THREE_TURNS, chat_template=template, tokenize=True, return_dict=True)
    assert ids == list(rendered["input_ids"])
    tokens = tokenizer.convert_ids_to_tokens(ids)
    runs = [tokens[a:b] for a, b in _runs(mask)]
    assert runs == [tokenizer.tokenize(answer) + [END_OF_TURN[name]] for answer in ANSWERS]
    # the two paths agree token for token
    other = _without_markers(template) if markers else BUILTIN_TEMPLATES[name]
    assert assistant_mask(tokenizer, THREE_TURNS, other) == (ids, mask)


@pytest.mark.parametrize("markers", [True, False], ids=["generation-markers", "prefix-renders"])
@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_byte_level_mask_decodes_to_the_answers(name: str, markers: bool) -> None:
    """With a byte-level BPE whitespace is tokens; each marked run decodes to the answer and its end-of-turn token
    (and, rendered from prefixes, the newline chatml writes after it)."""
    tokenizer = byte_bpe([EXPECTED[name], *TEXTS], name)
    template = BUILTIN_TEMPLATES[name] if markers else _without_markers(BUILTIN_TEMPLATES[name])
    ids, mask = assistant_mask(tokenizer, THREE_TURNS, template)
    decoded = [tokenizer.decode(ids[a:b]) for a, b in _runs(mask)]
    trailing = "\n" if not markers and name in ("chatml", "qwen") else ""
    if name == "mistral":  # the space before an answer is marked when it merged into the answer's first token
        decoded = [text.removeprefix(" ") for text in decoded]
    assert decoded == [answer + END_OF_TURN[name] + trailing for answer in ANSWERS]


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    """Like reasoning templates that drop an earlier answer's thinking: a prefix is not the start of the whole."""
    template = (
        "{%- for message in messages -%}"
        "{%- set content = message['content'] -%}"
        "{%- if message['role'] == 'assistant' and not loop.last -%}"
        "{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    messages = [
        {"role": "user", "content": U1},
        {"role": "assistant", "content": "<think> two and two </think> four"},
        {"role": "user", "content": U2},
        {"role": "assistant", "content": A2},
    ]
    tokenizer = word_level([*TEXTS, "<think> two and two </think>"], "chatml")
    with pytest.raises(ConfigError) as info:
        assistant_mask(tokenizer, messages, template)
    message = str(info.value)
    assert "cannot mark assistant turns" in message and "message 1" in message
    assert "--chat_template" in message and "--assistant_only_loss false" in message and "\n" not in message
    # the last answer alone keeps its thinking: nothing rewritten, so it is marked
    ids, mask = assistant_mask(tokenizer, messages[:2], template)
    assert tokenizer.convert_ids_to_tokens([i for i, bit in zip(ids, mask, strict=True) if bit])[-1] == "<|im_end|>"


def test_resolve_template(tmp_path: Path) -> None:
    tokenizer = word_level(TEXTS, "chatml")
    assert resolve_template(tokenizer, None) == BUILTIN_TEMPLATES["chatml"]
    assert resolve_template(tokenizer, "mistral") == BUILTIN_TEMPLATES["mistral"]
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    assert resolve_template(tokenizer, None) == "{{ messages[0]['content'] }}"
    path = tmp_path / "mine.jinja"
    path.write_text("{{ 'x' }}", encoding="utf-8")
    assert resolve_template(tokenizer, str(path)) == "{{ 'x' }}"
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_template(tokenizer, str(tmp_path / "absent.jinja"))
    with pytest.raises(ConfigError) as info:
        resolve_template(tokenizer, "llama3")
    assert "chatml, llama-3, mistral, qwen" in str(info.value) and "Did you mean 'llama-3'" in str(info.value)


def test_template_tokens() -> None:
    assert template_tokens("chatml") == ["<|im_start|>", "<|im_end|>"] == template_tokens(None)
    assert "<|eot_id|>" in template_tokens("llama-3") and "[/INST]" in template_tokens("mistral")
    assert template_tokens("my.jinja") == []
    for name, template in BUILTIN_TEMPLATES.items():  # every literal special token of the template is listed
        for token in ("<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|begin_of_text|>", "[INST]", "</s>"):
            assert (token in template) == (token in template_tokens(name)), (name, token)
