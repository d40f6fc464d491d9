"""encode_sft: labels on the assistant answers / completion / every text token, and the truncation policies."""

from __future__ import annotations

import logging

import pytest
from datasets import Dataset

from tests.chat.tokenizer_kit import word_level
from trainer_ext.chat.encode import encode_sft
from trainer_ext.chat.templates import BUILTIN_TEMPLATES
from trainer_ext.errors import ConfigError

CHATML = BUILTIN_TEMPLATES["chatml"]
WORDS = "be brief what is two plus three four five six seven thanks you are welcome".split()


def _tokenizer():
    return word_level([" ".join(WORDS)], "chatml", post_process=True)


def _conversation(answers: list[str]) -> list[dict[str, str]]:
    turns = [{"role": "system", "content": "be brief"}]
    for i, answer in enumerate(answers):
        turns += [{"role": "user", "content": f"what is {WORDS[i + 4]}"}, {"role": "assistant", "content": answer}]
    return turns


ANSWERS = ["four", "five six", "seven thanks you"]


def _encode(rows: dict, max_seq_length: int = 128, assistant_only_loss: bool = True, truncation: str = "turns"):
    return encode_sft(
        Dataset.from_dict(rows), _tokenizer(), CHATML, max_seq_length, assistant_only_loss, truncation, "data.jsonl"
    )


def _learnt(tokenizer, row: dict) -> list[str]:
    return tokenizer.convert_ids_to_tokens([t for t in row["labels"] if t != -100])


def test_messages_learn_the_answers_and_their_end_of_turn() -> None:
    tokenizer = _tokenizer()
    out, stats = _encode({"messages": [_conversation(ANSWERS)]})
    assert stats == {"rows_in": 1, "kept": 1, "dropped": 0, "truncated": 0, "too_long": 0}
    row = out[0]
    assert out.column_names == ["input_ids", "labels"]
    rendered = tokenizer.apply_chat_template(_conversation(ANSWERS), chat_template=CHATML, return_dict=True)
    assert row["input_ids"] == list(rendered["input_ids"])
    assert all(label in (-100, token) for label, token in zip(row["labels"], row["input_ids"], strict=True))
    assert _learnt(tokenizer, row) == [t for a in ANSWERS for t in [*a.split(), "<|im_end|>"]]
    everything, _ = _encode({"messages": [_conversation(ANSWERS)]}, assistant_only_loss=False)
    assert everything[0]["labels"] == everything[0]["input_ids"] == row["input_ids"]


def test_prompt_completion_and_text() -> None:
    tokenizer = _tokenizer()
    out, _ = _encode({"prompt": ["what is two plus two", "what is"], "completion": [" four", " five[EOS]"]})
    first = tokenizer.convert_ids_to_tokens(out[0]["input_ids"])
    # [BOS] prompt completion [EOS] (appended) [EOS] (the tokenizer's own): the eos is appended once
    assert first == ["[BOS]", "what", "is", "two", "plus", "two", "four", "[EOS]", "[EOS]"]
    assert _learnt(tokenizer, out[0]) == ["four", "[EOS]", "[EOS]"]
    assert _learnt(tokenizer, out[1]) == ["five", "[EOS]", "[EOS]"]
    everything, _ = _encode({"prompt": ["what is"], "completion": [" four"]}, assistant_only_loss=False)
    assert everything[0]["labels"] == everything[0]["input_ids"]
    text, _ = _encode({"text": ["two plus two", ""]})
    assert tokenizer.convert_ids_to_tokens(text[0]["input_ids"]) == ["[BOS]", "two", "plus", "two", "[EOS]", "[EOS]"]
    assert text[0]["labels"] == text[0]["input_ids"] and len(text) == 2


def _lengths() -> list[int]:
    """Token counts of the conversation through its 1st, 2nd and 3rd answer."""
    tokenizer = _tokenizer()
    return [
        len(
            tokenizer.apply_chat_template(_conversation(ANSWERS[:n]), chat_template=CHATML, return_dict=True)[
                "input_ids"
            ]
        )
        for n in (1, 2, 3)
    ]


@pytest.mark.parametrize("assistant_only_loss", [True, False])
def test_turns_keeps_whole_turns_that_fit(caplog: pytest.LogCaptureFixture, assistant_only_loss: bool) -> None:
    one, two, three = _lengths()
    rows = {"messages": [_conversation(ANSWERS), _conversation(ANSWERS[:1]), _conversation(["five six " * 9])]}
    with caplog.at_level(logging.WARNING, logger="trainer_ext.chat.encode"):
        out, stats = _encode(rows, max_seq_length=two + 1, assistant_only_loss=assistant_only_loss)
    assert stats == {"rows_in": 3, "kept": 2, "dropped": 1, "truncated": 1, "too_long": 2}
    full = _tokenizer().apply_chat_template(_conversation(ANSWERS), chat_template=CHATML, return_dict=True)
    assert out[0]["input_ids"] == list(full["input_ids"])[:two]  # through the 2nd answer's <|im_end|>
    assert len(out[1]["input_ids"]) == one
    if assistant_only_loss:
        assert _learnt(_tokenizer(), out[0]) == ["four", "<|im_end|>", "five", "six", "<|im_end|>"]
    else:
        assert out[0]["labels"] == out[0]["input_ids"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"'data.jsonl': 2 of 3 conversations longer than {two + 1} tokens: 1 kept their first 2 whole turns, "
        "1 dropped (--chat_truncation turns)"
    ]
    assert three > two + 1


def test_drop_error_and_cut(caplog: pytest.LogCaptureFixture) -> None:
    one, two, three = _lengths()
    rows = {"messages": [_conversation(ANSWERS[:1]), _conversation(ANSWERS)]}
    out, stats = _encode(rows, max_seq_length=two, truncation="drop")
    assert stats == {"rows_in": 2, "kept": 1, "dropped": 1, "truncated": 0, "too_long": 1} and len(out) == 1
    with pytest.raises(ConfigError) as info:
        _encode(rows, max_seq_length=two, truncation="error")
    assert str(info.value) == (
        f"'data.jsonl' row 1 is {three} tokens, longer than --max_seq_length {two}; raise --max_seq_length, "
        "or pass --chat_truncation turns, drop or cut"
    )
    with caplog.at_level(logging.WARNING, logger="trainer_ext.chat.encode"):
        out, stats = _encode(rows, max_seq_length=two - 2, truncation="cut")
    assert stats["truncated"] == 1 and len(out[1]["input_ids"]) == two - 2
    full = _tokenizer().apply_chat_template(_conversation(ANSWERS), chat_template=CHATML, return_dict=True)
    assert out[1]["input_ids"] == list(full["input_ids"])[: two - 2]
    assert "1 cut to" in caplog.records[-1].getMessage()
    # a cut that leaves no answer: the row goes, counted as too long and dropped
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer_ext.chat.encode"):
        out, stats = _encode(rows, max_seq_length=one - 3, truncation="cut")
    assert stats == {"rows_in": 2, "kept": 0, "dropped": 2, "truncated": 0, "too_long": 2} and len(out) == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"'data.jsonl': 2 of 2 conversations longer than {one - 3} tokens: 2 dropped (no label in their first "
        f"{one - 3} tokens) (--chat_truncation cut)"
    ]


def test_text_and_prompt_completion_under_turns() -> None:
    out, stats = _encode({"text": ["two plus two " * 10, "four"]}, max_seq_length=8)
    assert [len(ids) for ids in out["input_ids"]] == [8, 4] and stats["truncated"] == 1
    out, stats = _encode({"prompt": ["what is", "what is"], "completion": [" four five six seven", " four"]}, 6)
    assert stats == {"rows_in": 2, "kept": 1, "dropped": 1, "truncated": 0, "too_long": 1}


def test_template_errors_name_the_row() -> None:
    raising = "{{ raise_exception('only user turns') }}"
    with pytest.raises(ConfigError, match="'data.jsonl' row 0: the chat template cannot render it: only user turns"):
        encode_sft(
            Dataset.from_dict({"messages": [_conversation(ANSWERS)]}),
            _tokenizer(),
            raising,
            64,
            True,
            "cut",
            "data.jsonl",
        )
    # a template that rewrites earlier turns cannot find the turns of a long row without assistant-only loss either
    rewriting = (
        "{%- for m in messages -%}{{- m['role'] + ' ' + (m['content'] if loop.last else 'x') + ' <|im_end|> ' -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- 'assistant ' -}}{%- endif -%}"
    )
    rows = Dataset.from_dict({"messages": [_conversation(ANSWERS)]})
    with pytest.raises(
        ConfigError, match="row 0 is .* tokens, longer than --max_seq_length 6, .*--chat_truncation cut"
    ):
        encode_sft(rows, _tokenizer(), rewriting, 6, False, "turns", "data.jsonl")
    with pytest.raises(ConfigError, match="--chat_truncation 'keep' is not one of turns, drop, error, cut"):
        encode_sft(rows, _tokenizer(), CHATML, 6, False, "keep", "data.jsonl")
