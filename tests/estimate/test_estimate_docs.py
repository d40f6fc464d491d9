"""The example of docs/estimate.md runs as written (its model config is shipped) and prints what the page shows;
a from-scratch config's vocab_size replaced by the tokenizer's is said in the output."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from trainer_ext.cli.main import main

DOC = ROOT / "docs" / "estimate.md"
TIMING = re.compile(r"estimated in [0-9.]+s")


def documented_example() -> tuple[list[str], list[str]]:
    """The ``$ trainer-ext estimate ...`` command of the page (continuation lines joined) and the lines it shows."""
    block = DOC.read_text(encoding="utf-8").split("```\n$ trainer-ext estimate", 1)[1].split("```", 1)[0]
    lines = ("trainer-ext estimate" + block).splitlines()
    command = ""
    while lines:
        line = lines.pop(0)
        command += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            break
    return shlex.split(command)[1:], lines


def test_the_70b_example_of_the_docs_runs_as_shown(capsys, monkeypatch) -> None:
    argv, shown = documented_example()
    assert "configs/estimate/llama70b.json" in argv and (ROOT / "configs/estimate/llama70b.json").is_file()
    monkeypatch.chdir(ROOT)
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [TIMING.sub("", line) for line in out] == [TIMING.sub("", line) for line in shown]
    assert "note: vocab_size 32,000 of --model_config configs/estimate/llama70b.json replaced by 91" in "\n".join(out)


def tiny_llama(path: Path, vocab_size: int) -> str:
    config = dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        vocab_size=vocab_size,
    )
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(("vocab_size", "said"), [(32000, True), (91, False)])
def test_a_replaced_vocab_size_is_said(tmp_path: Path, capsys, vocab_size: int, said: bool) -> None:
    config = tiny_llama(tmp_path / "config.json", vocab_size)
    assert main(["estimate", "--task", "causal-lm", "--model_config", config, "--max_seq_length", "64"]) == 0
    out = capsys.readouterr().out
    note = (
        f"note: vocab_size 32,000 of --model_config {config} replaced by 91, the size of the word-level tokenizer "
        "built from the training data: train sizes a model from scratch to its tokenizer"
    )
    assert (note in out) is said, out
    assert "vocabulary 91" in out.splitlines()[0]


def test_a_preset_names_no_vocabulary_to_replace(capsys) -> None:
    assert main(["estimate", "--task", "causal-lm", "--model_config", "tiny-llama", "--max_seq_length", "64"]) == 0
    assert "note:" not in capsys.readouterr().out
