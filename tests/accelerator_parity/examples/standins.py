"""Local stand-ins for the hub names accelerate's example scripts load, built under those names in one folder.

A script run with that folder as its working directory finds them before the hub (a local path wins):
``bert-base-cased/`` (a 2-layer BERT with 32 hidden units, random weights from a fixed seed, and a cased WordPiece
tokenizer whose vocabulary is the data's words plus every character, so any text tokenizes), ``nyu-mll/glue/`` (a
dataset folder whose README declares config ``mrpc``: train/validation/test JSON lines with MRPC's columns
``sentence1``, ``sentence2``, ``label``, ``idx``) and ``glue/glue.py`` (an ``evaluate`` metric module: accuracy and
F1 of the positive class, as GLUE's ``mrpc`` config reports them). Everything is generated deterministically.

Sizes: 88 training rows make 5 batches of 16 with ``drop_last=True`` (odd: on 2 processes accelerate reads the
batch sampler past the last even round) and 6 without (the last one of 8 rows); 70 validation rows make 3
evaluation batches of 32 (the last of 6: on 2 processes one rank's share is padded and trimmed again).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

TRAIN_ROWS = 88
VALIDATION_ROWS = 70
TEST_ROWS = 20
NAMES = ("bert-base-cased", "nyu-mll", "glue")  # what a run folder links to

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ADJECTIVES = ["quiet", "bright", "heavy", "early", "small", "local", "Northern", "old", "new", "calm"]
NOUNS = ["council", "river", "market", "engine", "teacher", "garden", "company", "village", "report", "team"]
SYNONYMS = {"said": "stated", "bought": "acquired", "closed": "shut", "opened": "launched", "left": "departed"}
DAYS = ["Monday", "Tuesday", "Friday", "yesterday", "today"]

METRIC_MODULE = '''"""Stand-in for the hub metric ``glue`` (config ``mrpc``): accuracy and F1 of label 1."""

import datasets
import evaluate


class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name != "mrpc":
            raise KeyError(f"this stand-in serves only the mrpc config, not {self.config_name!r}")
        return evaluate.MetricInfo(
            description="accuracy and F1 (positive class 1) of paraphrase predictions",
            citation="",
            inputs_description="predictions and references: lists of 0/1 labels",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        pairs = list(zip(predictions, references))
        hits = sum(int(p == r) for p, r in pairs)
        true_pos = sum(int(p == 1 and r == 1) for p, r in pairs)
        false_pos = sum(int(p == 1 and r == 0) for p, r in pairs)
        false_neg = sum(int(p == 0 and r == 1) for p, r in pairs)
        denominator = 2 * true_pos + false_pos + false_neg
        return {
            "accuracy": hits / len(pairs) if pairs else 0.0,
            "f1": 2 * true_pos / denominator if denominator else 0.0,
        }
'''


def _sentence_pair(rng: random.Random) -> tuple[str, str, int]:
    """Two sentences about the same event (label 1, a synonym swapped in) or about another subject (label 0)."""
    adjective, noun, day = rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(DAYS)
    verb, synonym = rng.choice(sorted(SYNONYMS.items()))
    other = rng.choice(NOUNS)
    first = f"The {adjective} {noun} {verb} the {other} on {day} ."
    if rng.random() < 0.6:
        return first, f"On {day} , the {adjective} {noun} {synonym} the {other} .", 1
    changed = rng.choice([n for n in NOUNS if n != noun])
    return first, f"On {day} , the {rng.choice(ADJECTIVES)} {changed} {synonym} the {other} .", 0


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for idx in range(n):
        first, second, label = _sentence_pair(rng)
        out.append({"sentence1": first, "sentence2": second, "label": label, "idx": idx})
    return out


def vocabulary() -> list[str]:
    """Special tokens, every word the data uses, then characters alone and as continuations (``##x``)."""
    words = {"The", "the", "On", "on", ".", ","} | set(ADJECTIVES) | set(NOUNS) | set(DAYS)
    words |= set(SYNONYMS) | set(SYNONYMS.values())
    chars = string.ascii_letters + string.digits + string.punctuation
    return SPECIALS + sorted(words - set(chars)) + list(chars) + [f"##{c}" for c in chars]


def build(root: Path) -> Path:
    """Write the three stand-ins under ``root`` (created); returns ``root``."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    root.mkdir(parents=True, exist_ok=True)
    data = root / "nyu-mll" / "glue"
    (data / "mrpc").mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", TRAIN_ROWS, 1), ("validation", VALIDATION_ROWS, 2), ("test", TEST_ROWS, 3)):
        lines = [json.dumps(row) for row in rows(n, seed)]
        (data / "mrpc" / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    splits = "".join(f"  - split: {s}\n    path: mrpc/{s}.jsonl\n" for s in ("train", "validation", "test"))
    (data / "README.md").write_text(
        f"---\nconfigs:\n- config_name: mrpc\n  data_files:\n{splits}---\n\n"
        "Stand-in for GLUE's MRPC config (generated sentence pairs; tests/accelerator_parity/examples).\n"
    )

    metric = root / "glue"
    metric.mkdir(exist_ok=True)
    (metric / "glue.py").write_text(METRIC_MODULE)

    model_dir = root / "bert-base-cased"
    vocab = vocabulary()
    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=False)
    tokenizer.model_max_length = 64
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config, add_pooling_layer=True).save_pretrained(model_dir)
    return root


def link_into(standins: Path, run_dir: Path) -> None:
    """Make ``run_dir`` a working directory in which the scripts find the stand-ins (symbolic links)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        (run_dir / name).symlink_to(standins / name, target_is_directory=True)
