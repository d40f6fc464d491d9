"""What a ``resume_from_checkpoint`` value asks for: the boolean words are those of every other yes/no option."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_ext.checkpointing.selection import AUTO, resume_request
from trainer_ext.values import FALSE_WORDS, TRUE_WORDS, parse_bool


@pytest.mark.parametrize("word", [*TRUE_WORDS, "latest", "LAST", " True "])
def test_true_words_ask_for_the_newest_checkpoint(word: str) -> None:
    assert resume_request(word) is True


@pytest.mark.parametrize("word", [*FALSE_WORDS, "None", "", None, False])
def test_false_words_start_fresh(word) -> None:
    assert resume_request(word) is None


def test_the_vocabulary_is_the_boolean_parsers() -> None:
    for word in TRUE_WORDS:
        assert parse_bool(word) is True and resume_request(word.upper()) is True
    for word in FALSE_WORDS:
        assert parse_bool(word) is False and resume_request(word.upper()) is None


def test_auto_true_and_paths() -> None:
    assert resume_request("Auto") == AUTO
    assert resume_request(True) is True
    assert resume_request("out/checkpoint-5") == "out/checkpoint-5"
    assert resume_request(Path("out") / "checkpoint-5") == str(Path("out") / "checkpoint-5")
