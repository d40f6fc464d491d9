"""Regenerate the shipped data files deterministically, so the default job's data is reproducible.

Run ``python -m trainer_ext.job.builtin_data.make_dataset`` to rewrite the files next to this module, or
``python -m trainer_ext.job.builtin_data.make_dataset --out DIR`` to write them elsewhere (the tests compare).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

SENTIMENT_FILE = "sentiment.jsonl"
CORPUS_FILE = "corpus.jsonl"
SENTIMENT_SIZE = 4000
CORPUS_SIZE = 3000

SUBJECTS = [
    "the movie",
    "this film",
    "the acting",
    "the plot",
    "the soundtrack",
    "the ending",
    "the dialogue",
    "the cast",
    "the story",
    "the script",
    "the visuals",
    "the pacing",
    "the lead actor",
    "the sequel",
    "the camera work",
    "the humour",
    "the first half",
    "the finale",
    "the music",
    "the characters",
]
NOUNS = ["movie", "film", "story", "experience", "evening", "cast", "script", "ending", "show", "premiere"]
POSITIVE = [
    "good",
    "great",
    "wonderful",
    "brilliant",
    "delightful",
    "charming",
    "moving",
    "superb",
    "excellent",
    "enjoyable",
    "fun",
    "gripping",
    "clever",
    "beautiful",
    "funny",
    "fresh",
    "thrilling",
    "touching",
    "memorable",
    "stunning",
    "smart",
    "lovely",
    "warm",
    "sharp",
]
NEGATIVE = [
    "bad",
    "awful",
    "boring",
    "dull",
    "terrible",
    "weak",
    "messy",
    "tedious",
    "bland",
    "clumsy",
    "painful",
    "forgettable",
    "predictable",
    "lifeless",
    "annoying",
    "flat",
    "silly",
    "slow",
    "confusing",
    "lazy",
    "stale",
    "shallow",
    "cheap",
    "poor",
]
INTENSIFIERS = ["", "", "really", "very", "quite", "truly", "surprisingly", "incredibly", "rather", "so"]
OPENERS = ["", "", "", "honestly ,", "i thought", "i felt", "in my opinion", "overall ,", "to be fair ,"]
VERBS = ["was", "is", "felt", "seemed"]
NEGATED = ["was not", "is not", "wasn't", "isn't", "never felt", "did not feel"]


def _adjective(rng: random.Random, positive: bool) -> str:
    """An optionally intensified adjective of the given polarity."""
    adj = rng.choice(POSITIVE if positive else NEGATIVE)
    intensifier = rng.choice(INTENSIFIERS)
    return f"{intensifier} {adj}" if intensifier else adj


def _review(rng: random.Random) -> tuple[str, int]:
    """One synthetic review and its label (1 positive, 0 negative); some need word order to get right."""
    label = rng.randint(0, 1)
    opener = rng.choice(OPENERS)
    subject = rng.choice(SUBJECTS)
    kind = rng.random()
    if kind < 0.35:
        text = f"{opener} {subject} {rng.choice(VERBS)} {_adjective(rng, bool(label))} ."
    elif kind < 0.55:
        # Negation flips the adjective's polarity: the label depends on two words, not one.
        text = f"{opener} {subject} {rng.choice(NEGATED)} {_adjective(rng, not label)} ."
    elif kind < 0.75:
        # Contrast: the clause after "but" decides.
        other = rng.choice([s for s in SUBJECTS if s != subject])
        first = _adjective(rng, not label)
        text = f"{subject} was {first} , but {other} was {_adjective(rng, bool(label))} ."
    elif kind < 0.88:
        text = f"what a {rng.choice(POSITIVE if label else NEGATIVE)} {rng.choice(NOUNS)} !"
    else:
        second = rng.choice(POSITIVE if label else NEGATIVE)
        text = f"{opener} {subject} was {_adjective(rng, bool(label))} and {second} ."
    return " ".join(text.split()), label


def sentiment_rows(n: int = SENTIMENT_SIZE, seed: int = 0) -> list[dict]:
    """``n`` distinct reviews labelled 'positive' or 'negative', roughly balanced."""

    def row(rng: random.Random) -> dict:
        text, label = _review(rng)
        return {"text": text, "label": "positive" if label else "negative"}

    return _distinct_rows(n, seed, row)


NAMES = ["anna", "ben", "cleo", "dev", "emma", "finn", "gita", "hugo", "ines", "jack", "kira", "leo"]
ANIMALS = ["cat", "dog", "fox", "owl", "bear", "duck", "frog", "goat", "horse", "mouse"]
COLOURS = ["red", "blue", "green", "yellow", "brown", "white", "black", "grey"]
PLACES = ["park", "river", "market", "school", "garden", "forest", "beach", "library", "farm", "station"]
FRUITS = {
    "apple": "apples",
    "pear": "pears",
    "plum": "plums",
    "peach": "peaches",
    "lemon": "lemons",
    "orange": "oranges",
    "cherry": "cherries",
    "mango": "mangoes",
}
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _story(rng: random.Random) -> str:
    """One short story from a small grammar; later words are predictable from earlier ones."""
    name, animal, place = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(PLACES)
    kind = rng.random()
    if kind < 0.4:
        n = rng.randint(2, 10)
        fruit = rng.choice(sorted(FRUITS))
        left = FRUITS[fruit] if n > 2 else fruit
        return f"{name} has {NUMBERS[n - 1]} {FRUITS[fruit]} . {name} eats one {fruit} . now {name} has {NUMBERS[n - 2]} {left} ."
    if kind < 0.75:
        colour = rng.choice(COLOURS)
        return (
            f"{name} saw a {colour} {animal} at the {place} . the {colour} {animal} ran away . "
            f"{name} went home from the {place} ."
        )
    return f"every morning {name} walks to the {place} with the {animal} . the {animal} likes the {place} ."


def corpus_rows(n: int = CORPUS_SIZE, seed: int = 1) -> list[dict]:
    """``n`` distinct short stories for the causal-lm example."""
    return _distinct_rows(n, seed, lambda rng: {"text": _story(rng)})


def _distinct_rows(n: int, seed: int, make: Callable[[random.Random], dict]) -> list[dict]:
    """Draw rows from ``make`` until ``n`` distinct texts exist, so no eval text repeats a train text."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    for _ in range(100 * n):
        row = make(rng)
        if row["text"] not in seen:
            seen.add(row["text"])
            rows.append(row)
            if len(rows) == n:
                return rows
    raise RuntimeError(f"the grammar yields fewer than {n} distinct rows")


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Write rows as JSON lines with stable formatting."""
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows), encoding="utf-8")


def write_all(out_dir: Path) -> list[Path]:
    """Write every shipped data file into ``out_dir`` and return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / SENTIMENT_FILE, out_dir / CORPUS_FILE]
    write_jsonl(sentiment_rows(), paths[0])
    write_jsonl(corpus_rows(), paths[1])
    return paths


def main(argv: list[str] | None = None) -> int:
    """Command line: regenerate the data files."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="directory to write into")
    args = parser.parse_args(argv)
    for path in write_all(args.out):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
