"""The shipped chat and preference data: reproducible from its generator, valid, small, and using every role."""

from __future__ import annotations

import json
import re
from collections import Counter

from trainer_ext.job.builtin_data import CHAT, DATA_DIR, PREFERENCES, make_chat_data

ROLES = {"system", "user", "assistant", "tool"}


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _check_messages(messages: object, where: str) -> list[dict]:
    assert isinstance(messages, list) and messages, f"{where}: not a non-empty list of messages"
    for message in messages:
        assert set(message) == {"role", "content"}, f"{where}: keys {sorted(message)}"
        assert message["role"] in ROLES, f"{where}: role {message['role']!r}"
        assert isinstance(message["content"], str) and message["content"].strip(), f"{where}: empty content"
    return messages


def test_shipped_files_equal_a_fresh_generation(tmp_path):
    assert make_chat_data.stale_files(DATA_DIR, tmp_path) == []
    assert make_chat_data.main(["--check", "--out", str(DATA_DIR)]) == 0


def test_check_notices_an_edited_file(tmp_path):
    make_chat_data.write_all(tmp_path)
    edited = tmp_path / make_chat_data.CHAT_FILE
    edited.write_text(edited.read_text(encoding="utf-8").replace("is", "was", 1), encoding="utf-8")
    assert make_chat_data.stale_files(tmp_path, tmp_path / "scratch") == [edited]
    assert make_chat_data.main(["--check", "--out", str(tmp_path)]) == 1


def test_generation_is_deterministic():
    assert make_chat_data.chat_rows(50) == make_chat_data.chat_rows(50)
    assert make_chat_data.preference_rows(50) == make_chat_data.preference_rows(50)
    assert make_chat_data.chat_rows(50) != make_chat_data.chat_rows(50, seed=7)


def test_chat_rows_are_valid_conversations_using_every_role():
    rows = _rows(CHAT)
    assert len(rows) == make_chat_data.CHAT_SIZE
    assert CHAT.stat().st_size < 500_000
    assert len({json.dumps(r, sort_keys=True) for r in rows}) == len(rows)
    roles, assistant_turns, with_system = Counter(), Counter(), 0
    for i, row in enumerate(rows):
        assert set(row) == {"messages"}, f"row {i}: keys {sorted(row)}"
        messages = _check_messages(row["messages"], f"row {i}")
        kinds = [m["role"] for m in messages]
        roles.update(kinds)
        assert "system" not in kinds[1:], f"row {i}: a system message after the first"
        body = kinds[1:] if kinds[0] == "system" else kinds
        assert body[0] == "user" and body[-1] == "assistant", f"row {i}: {kinds}"
        for before, after in zip(body, body[1:], strict=False):
            assert after != before, f"row {i}: two {after} turns in a row"
            if after == "tool":
                assert before == "assistant", f"row {i}: a tool answer that nobody asked for"
        assistant_turns[kinds.count("assistant")] += 1
        with_system += kinds[0] == "system"
        assert make_chat_data.conversation_words(messages) <= make_chat_data.MAX_WORDS, f"row {i} is too long"
    assert set(roles) == ROLES
    assert roles["tool"] >= 10
    assert 0.15 < with_system / len(rows) < 0.35
    assert assistant_turns[1] > 100 and assistant_turns[2] + assistant_turns[3] > 100
    assert max(assistant_turns) <= 3


def test_preference_rows_are_valid_and_chosen_differs_from_rejected():
    rows = _rows(PREFERENCES)
    assert len(rows) == make_chat_data.PREFERENCES_SIZE
    assert PREFERENCES.stat().st_size < 500_000
    assert len({r["prompt"][0]["content"] for r in rows}) == len(rows), "prompts repeat"
    for i, row in enumerate(rows):
        assert set(row) == {"prompt", "chosen", "rejected"}, f"row {i}: keys {sorted(row)}"
        prompt = _check_messages(row["prompt"], f"row {i} prompt")
        chosen = _check_messages(row["chosen"], f"row {i} chosen")
        rejected = _check_messages(row["rejected"], f"row {i} rejected")
        assert [m["role"] for m in prompt] == ["user"]
        assert [m["role"] for m in chosen] == [m["role"] for m in rejected] == ["assistant"]
        assert chosen != rejected, f"row {i}: chosen equals rejected"
        assert make_chat_data.conversation_words(prompt + chosen) <= make_chat_data.MAX_WORDS


def _claims(text: str) -> tuple[str, str] | None:
    """(what, value) for answers that state a fact or a sum: ('banana', 'yellow'), ('3 plus 4', '7')."""
    for pattern in (
        r"an? (\w+) is (\w+) \.",
        r"the capital of (\w+) is (\w+) \.",
        r"(\d+ (?:plus|minus) \d+) is (\d+) \.",
    ):
        match = re.fullmatch(pattern, text)
        if match:
            return match.group(1), match.group(2)
    return None


def _truth(what: str, value: str) -> bool:
    if what in make_chat_data.FRUIT_COLOURS:
        return make_chat_data.FRUIT_COLOURS[what] == value
    if what in make_chat_data.CAPITALS:
        return make_chat_data.CAPITALS[what] == value
    a, op, b = what.split()
    return (int(a) + int(b) if op == "plus" else int(a) - int(b)) == int(value)


def test_chosen_answers_are_true_and_rejected_ones_false():
    """Where an answer states a colour, a capital or a sum, the chosen one is true and the rejected one false."""
    checked = 0
    for i, row in enumerate(_rows(PREFERENCES)):
        chosen, rejected = _claims(row["chosen"][0]["content"]), _claims(row["rejected"][0]["content"])
        if chosen is None:
            continue
        assert rejected is not None and rejected[0] == chosen[0], f"row {i}: {row}"
        assert _truth(*chosen) and not _truth(*rejected), f"row {i}: {row}"
        checked += 1
    assert checked > 150
