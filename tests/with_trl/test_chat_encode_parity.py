"""trainer_ext.chat.encode_sft against TRL's SFTTrainer: the same input_ids and labels, row for row.

TRL's prepared train_dataset (its tokenisation, assistant / completion masks and keep_start truncation) is compared
with ``encode_sft`` on the same canonical rows and tokenizer: conversations with assistant-only loss (a built-in
template's generation markers), prompt/completion strings with completion-only loss, and text.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from tests.chat.tokenizer_kit import word_level  # noqa: E402
from trainer_ext.chat.encode import encode_sft  # noqa: E402
from trainer_ext.chat.templates import BUILTIN_TEMPLATES  # noqa: E402

MAX_LENGTH = 40
WORDS = "what is two plus three four five six seven the sky blue green thanks you are welcome a b c d e f".split()


def _words(start: int, count: int) -> str:
    return " ".join(WORDS[(start + k) % len(WORDS)] for k in range(count))


def _conversation(i: int) -> list[dict[str, str]]:
    turns = [{"role": "system", "content": "be brief"}] if i % 2 else []
    for turn in range(1 + i % 3 + 3 * (i == 7)):  # row 7 runs past MAX_LENGTH
        turns.append({"role": "user", "content": _words(i + turn, 3 + turn)})
        turns.append({"role": "assistant", "content": _words(2 * i + turn, 4)})
    return turns


ROWS = {
    "messages": Dataset.from_dict({"messages": [_conversation(i) for i in range(12)]}),
    "prompt-completion": Dataset.from_dict(  # row 5's prompt alone, row 3 with its completion, pass MAX_LENGTH
        {
            "prompt": [_words(i, 2 + i % 5 + 50 * (i == 5)) for i in range(12)],
            "completion": [" " + _words(i + 1, 2 + 3 * (i % 4) + 40 * (i == 3)) for i in range(12)],
        }
    ),
    "text": Dataset.from_dict({"text": [_words(i, 3 + 9 * (i % 5)) for i in range(12)]}),
}


def _tokenizer(template: str):
    tokenizer = word_level([" ".join(WORDS), "be brief"], template, post_process=True)
    tokenizer.chat_template = BUILTIN_TEMPLATES[template]
    return tokenizer


def _trl(tmp_path, rows: Dataset, tokenizer, **config) -> Dataset:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(
        transformers.LlamaConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=len(tokenizer),
        )
    )
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_length=MAX_LENGTH,
        shuffle_dataset=False,
        report_to=[],
        use_cpu=True,
        **config,
    )
    return SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer).train_dataset


@pytest.mark.parametrize("template", ["chatml", "llama-3", "mistral"])
@pytest.mark.parametrize(
    ("kind", "loss_on_answers"),
    [
        ("messages", True),
        ("messages", False),
        ("prompt-completion", True),
        ("prompt-completion", False),
        ("text", False),
    ],
)
def test_encode_sft_matches_trl(tmp_path, template: str, kind: str, loss_on_answers: bool) -> None:
    tokenizer = _tokenizer(template)
    rows = ROWS[kind]
    config = dict(assistant_only_loss=loss_on_answers) if kind == "messages" else {}
    if kind == "prompt-completion":
        config = dict(completion_only_loss=loss_on_answers)
    theirs = _trl(tmp_path, rows, tokenizer, **config)
    ours, stats = encode_sft(
        rows, tokenizer, BUILTIN_TEMPLATES[template], MAX_LENGTH, loss_on_answers, "cut", f"{kind} rows"
    )
    assert stats["rows_in"] == len(rows) and stats["kept"] == len(theirs)
    assert stats["truncated"] > 0  # some rows are cut at MAX_LENGTH, as TRL cuts them
    if kind == "prompt-completion" and loss_on_answers:  # a prompt alone longer than MAX_LENGTH: no labels left
        assert stats["dropped"] == 1 and len(theirs) == len(rows) - 1
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["labels"] == theirs["labels"]
    if loss_on_answers:
        assert any(-100 in labels for labels in ours["labels"])
