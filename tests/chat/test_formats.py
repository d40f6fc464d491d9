"""Chat data formats: column detection, column mapping, and canonical rows from json/jsonl/csv/parquet files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import datasets
import pytest

from trainer_ext.chat.formats import detect_format, parse_column_mapping, to_canonical
from trainer_ext.errors import ConfigError

SYSTEM, Q1, A1, Q2, A2 = "be brief", "what is two plus two", "four", "and three plus three", "six"
OPENAI = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": Q1},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": Q2},
    {"role": "assistant", "content": A2},
]


def _write(tmp_path: Path, rows: list[dict], kind: str) -> str:
    path = tmp_path / f"data.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif kind == "json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif kind == "csv":
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def _load(tmp_path: Path, rows: list[dict], kind: str = "jsonl") -> tuple[datasets.Dataset, str]:
    path = _write(tmp_path, rows, kind)
    builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}[kind]
    return datasets.load_dataset(builder, data_files={"train": path}, split="train"), Path(path).name


def _canonical(tmp_path, rows, kind="jsonl", task="sft", data_format="auto", mapping=None):
    dataset, source = _load(tmp_path, rows, kind)
    mapping = parse_column_mapping(mapping)
    fmt = detect_format(dataset.column_names, task, data_format, mapping)
    return fmt, to_canonical(dataset, fmt, mapping, source)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
def test_openai_messages(tmp_path: Path, kind: str) -> None:
    fmt, out = _canonical(tmp_path, [{"messages": OPENAI, "id": 1}, {"messages": OPENAI[1:3], "id": 2}], kind)
    assert fmt == "messages"
    assert out.column_names == ["messages"]
    assert out[0]["messages"] == OPENAI
    assert out[1]["messages"] == OPENAI[1:3]


def test_sharegpt_conversations(tmp_path: Path) -> None:
    sharegpt = [
        {"from": "system", "value": SYSTEM},
        {"from": "human", "value": Q1},
        {"from": "gpt", "value": A1},
        {"from": "function", "value": "{}"},
        {"from": "gpt", "value": A2},
    ]
    fmt, out = _canonical(tmp_path, [{"conversations": sharegpt}])
    assert fmt == "messages"
    roles = [m["role"] for m in out[0]["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert [m["content"] for m in out[0]["messages"]] == [SYSTEM, Q1, A1, "{}", A2]


def test_alpaca(tmp_path: Path) -> None:
    rows = [
        {"instruction": "add", "input": "2 and 2", "output": "4", "system": SYSTEM},
        {"instruction": "say hi", "input": "", "output": "hi", "system": ""},
    ]
    for kind in ("jsonl", "csv"):
        fmt, out = _canonical(tmp_path, rows, kind)
        assert fmt == "alpaca"
        assert out[0]["messages"] == [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "add\n\n2 and 2"},
            {"role": "assistant", "content": "4"},
        ]
        assert out[1]["messages"] == [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]


def test_prompt_completion_strings_and_numbers_from_csv(tmp_path: Path) -> None:
    fmt, out = _canonical(tmp_path, [{"prompt": "2+2=", "completion": 4}, {"prompt": "3+3=", "completion": 6}], "csv")
    assert fmt == "prompt-completion"
    assert out.column_names == ["prompt", "completion"]
    assert out[0] == {"prompt": "2+2=", "completion": "4"}


def test_prompt_completion_messages_become_a_conversation(tmp_path: Path) -> None:
    rows = [{"prompt": OPENAI[:2], "completion": OPENAI[2:3]}]
    fmt, out = _canonical(tmp_path, rows)
    assert fmt == "prompt-completion"
    assert out.column_names == ["messages"]
    assert out[0]["messages"] == OPENAI[:3]


def test_text(tmp_path: Path) -> None:
    fmt, out = _canonical(tmp_path, [{"text": "a b c"}, {"text": ""}], "parquet")
    assert fmt == "text"
    assert out["text"] == ["a b c", ""]


def test_preference_explicit_and_implicit(tmp_path: Path) -> None:
    good, bad = {"role": "assistant", "content": "blue"}, {"role": "assistant", "content": "green"}
    user = {"role": "user", "content": "sky colour"}
    fmt, out = _canonical(tmp_path, [{"prompt": [user], "chosen": [good], "rejected": [bad]}], task="dpo")
    assert fmt == "preference"
    assert out[0] == {"prompt": [user], "chosen": [good], "rejected": [bad]}
    fmt, out = _canonical(tmp_path, [{"chosen": [user, good], "rejected": [user, bad]}], task="dpo")
    assert out[0] == {"prompt": [user], "chosen": [good], "rejected": [bad]}
    # chosen == rejected is allowed (nothing to prefer, but not malformed)
    _, out = _canonical(tmp_path, [{"chosen": [user, good], "rejected": [user, good]}], task="dpo")
    assert out[0]["chosen"] == out[0]["rejected"] == [good]
    # strings: the shared prefix is the prompt, the space goes with the answers (as TRL's extract_prompt)
    _, out = _canonical(tmp_path, [{"chosen": "the sky is blue", "rejected": "the sky is green"}], task="dpo")
    assert out[0] == {"prompt": "the sky is", "chosen": " blue", "rejected": " green"}
    _, out = _canonical(tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "b"}], "csv", task="dpo")
    assert out[0] == {"prompt": "q", "chosen": "a", "rejected": "b"}


def test_column_mapping(tmp_path: Path) -> None:
    assert parse_column_mapping(None) == {} == parse_column_mapping("")
    assert parse_column_mapping(" prompt = question , completion=answer,") == {
        "prompt": "question",
        "completion": "answer",
    }
    assert parse_column_mapping({"messages": "conv"}) == {"messages": "conv"}
    fmt, out = _canonical(
        tmp_path, [{"question": "2+2", "answer": "4", "x": 1}], mapping="prompt=question,completion=answer"
    )
    assert fmt == "prompt-completion"
    assert out[0] == {"prompt": "2+2", "completion": "4"}
    fmt, out = _canonical(tmp_path, [{"chat": OPENAI}], mapping="messages=chat")
    assert fmt == "messages" and out[0]["messages"] == OPENAI


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prompt", "is not name=column"),
        ("prompt=", "is not name=column"),
        ("promt=question", "Did you mean 'prompt'"),
        ("prompt=a,prompt=b", "maps 'prompt' twice"),
    ],
)
def test_malformed_column_mapping(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        parse_column_mapping(text)
    assert "\n" not in str(info.value)


def test_detection_errors() -> None:
    with pytest.raises(ConfigError) as info:
        detect_format(["question", "answer"], "sft", "auto", {})
    message = str(info.value)
    assert "no 'messages' column" in message and "columns: question, answer" in message
    assert "prompt-completion (prompt, completion)" in message and "--column_mapping prompt=question" in message
    with pytest.raises(ConfigError, match="no 'rejected' column .*columns: prompt, chosen"):
        detect_format(["prompt", "chosen"], "dpo", "auto", {})
    with pytest.raises(ConfigError, match="--data_format text is not read by --task dpo"):
        detect_format(["text"], "dpo", "text", {})
    with pytest.raises(ConfigError, match="needs the column 'completion'"):
        detect_format(["prompt", "text"], "sft", "prompt-completion", {})
    with pytest.raises(ConfigError, match="no such column .*Did you mean 'question'"):
        detect_format(["question", "answer"], "sft", "auto", {"prompt": "questoin"})
    assert detect_format(["messages", "text"], "sft", "auto", {}) == "messages"
    assert detect_format(["prompt", "completion", "text"], "sft", "text", {}) == "text"
    assert detect_format(["prompt", "chosen", "rejected"], "dpo", "auto", {}) == "preference"


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (
            [{"messages": OPENAI}, {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}],
            "'data.jsonl' row 1: message 1 has role 'bot'; roles understood: system, user, assistant, tool "
            "(ShareGPT: human, gpt, system, tool, function)",
        ),
        ([{"messages": [{"role": "user", "content": 3}]}], "row 0: message 0 (user) has int content, not text"),
        ([{"messages": [{"role": "user", "content": None}]}], "row 0: message 0 (user) has no content"),
        ([{"messages": OPENAI}, {"messages": []}], "row 1: 'messages' is an empty conversation"),
        ([{"messages": OPENAI}, {"messages": None}], "row 1: 'messages' is an empty conversation"),
        ([{"messages": OPENAI[:2]}], "row 0: 'messages' has no assistant message"),
        ([{"conversations": [{"from": "robot", "value": "x"}]}], "message 0 has role 'robot'"),
        ([{"prompt": "a", "completion": "b"}, {"prompt": None, "completion": "b"}], "row 1: 'prompt' is empty"),
        ([{"prompt": "a", "completion": OPENAI[2:3]}], "'prompt' is text but 'completion' is a list"),
        ([{"prompt": OPENAI[:2], "completion": OPENAI[1:2]}], "row 0: 'completion' has no assistant message"),
        ([{"instruction": "a", "output": None}], "row 0: 'output' is empty"),
        ([{"text": "a"}, {"text": None}], "row 1: 'text' is empty"),
    ],
)
def test_malformed_rows(tmp_path: Path, rows: list[dict], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        _canonical(tmp_path, rows)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([{"chosen": "abc", "rejected": "xyz"}], "row 0: chosen and rejected share no prompt"),
        ([{"prompt": "q", "chosen": None, "rejected": "b"}], "row 0: 'chosen' is empty"),
        ([{"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}], "all as text"),
        (
            [{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}],
              "rejected": [{"role": "assistant", "content": "b"}]}],
            "row 0: 'chosen' has no assistant message",
        ),
    ],
)  # fmt: skip
def test_malformed_preference_rows(tmp_path: Path, rows: list[dict], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        _canonical(tmp_path, rows, task="dpo")
