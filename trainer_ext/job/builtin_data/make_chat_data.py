"""Regenerate the shipped chat and preference data deterministically, so ``--task sft`` and ``--task dpo`` need no
network and their runs are reproducible.

``chat.jsonl`` holds conversations in the OpenAI form, ``{"messages": [{"role": ..., "content": ...}, ...]}``:
single-turn and multi-turn (two or three assistant turns) ones, about a quarter with a system message, and a few
in which the assistant calls a tool and the tool answers, so every role a chat job understands occurs.
``preferences.jsonl`` holds ``{"prompt": [user], "chosen": [assistant], "rejected": [assistant]}`` rows: the chosen
answer is right, the rejected one is plausible but wrong (off by one, another fruit's colour, ...).

All text is made up here from small tables (arithmetic on small numbers, fruit colours, capitals of made-up
countries, animal sounds, legs, units, counting, repeating and reversing short lists), so a two-layer model trained
from scratch with a word-level tokenizer learns it in a few hundred steps and its loss falls visibly. Every
conversation stays well under the default ``--max_seq_length`` of 128 tokens with a chat template's markers.

Run ``python -m trainer_ext.job.builtin_data.make_chat_data`` to rewrite the files next to this module,
``--out DIR`` to write them elsewhere, or ``--check`` to verify the shipped files equal a fresh generation.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path

from trainer_ext.job.builtin_data.make_dataset import write_jsonl

CHAT_FILE = "chat.jsonl"
PREFERENCES_FILE = "preferences.jsonl"
CHAT_SIZE = 400
PREFERENCES_SIZE = 400
MAX_WORDS = 100  # words of a conversation plus four per message (a chat template's markers)

FRUIT_COLOURS = {
    "banana": "yellow",
    "lemon": "yellow",
    "apple": "red",
    "cherry": "red",
    "lime": "green",
    "pear": "green",
    "plum": "purple",
    "grape": "purple",
    "orange": "orange",
    "blueberry": "blue",
    "kiwi": "brown",
    "coconut": "brown",
}
CAPITALS = {
    "zorland": "mivo",
    "pellia": "tarn",
    "quosh": "elbin",
    "varda": "nusk",
    "kimora": "oste",
    "drovia": "kalm",
    "fennick": "ouro",
    "lumbo": "sarra",
    "wexor": "plim",
    "brendi": "faro",
}
ANIMAL_SOUNDS = {
    "cow": "moo",
    "dog": "woof",
    "cat": "meow",
    "duck": "quack",
    "sheep": "baa",
    "owl": "hoot",
    "pig": "oink",
    "horse": "neigh",
    "frog": "croak",
    "bee": "buzz",
}
LEGS = {"spider": 8, "ant": 6, "bee": 6, "dog": 4, "cat": 4, "horse": 4, "bird": 2, "duck": 2, "snake": 0, "crab": 10}
UNITS = [  # (bigger unit, smaller units, how many)
    ("week", "days", 7),
    ("day", "hours", 24),
    ("hour", "minutes", 60),
    ("minute", "seconds", 60),
    ("year", "months", 12),
    ("metre", "centimetres", 100),
    ("kilogram", "grams", 1000),
    ("dozen", "eggs", 12),
]
LIST_WORDS = ["cat", "dog", "fox", "owl", "sun", "moon", "tree", "cup", "box", "hat", "red", "blue"]
WEATHER = ["sunny", "rainy", "cloudy", "windy", "snowy", "foggy"]


class Item:
    """One question with its right answer, a short form of the answer and a plausible wrong answer."""

    def __init__(self, question: str, answer: str, short: str, wrong: str, follow: Callable | None = None) -> None:
        self.question, self.answer, self.short, self.wrong = question, answer, short, wrong
        self.follow = follow  # rng -> Item: a follow-up question that depends on this one


def _a(noun: str) -> str:
    """The noun with its indefinite article: 'a plum', 'an apple'."""
    return f"an {noun}" if noun[0] in "aeiou" or noun == "hour" else f"a {noun}"


def _off_by_one(rng: random.Random, n: int) -> int:
    return n + 1 if n == 0 or rng.random() < 0.5 else n - 1


def _add(rng: random.Random) -> Item:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    q = rng.choice([f"what is {a} plus {b} ?", f"what do you get when you add {a} and {b} ?", f"{a} plus {b} = ?"])
    total = a + b
    wrong = _off_by_one(rng, total)
    return Item(q, f"{a} plus {b} is {total} .", str(total), f"{a} plus {b} is {wrong} .", _followup_from(total))


def _subtract(rng: random.Random) -> Item:
    a = rng.randint(1, 18)
    b = rng.randint(0, min(a, 9))
    q = rng.choice([f"what is {a} minus {b} ?", f"take {b} away from {a} .", f"{a} minus {b} = ?"])
    left = a - b
    wrong = _off_by_one(rng, left)
    return Item(q, f"{a} minus {b} is {left} .", str(left), f"{a} minus {b} is {wrong} .", _followup_from(left))


def _followup_from(total: int) -> Callable[[random.Random], Item]:
    """A follow-up that continues from the last result: 'and plus 3 ?' -> '7 plus 3 is 10 .'."""

    def follow(rng: random.Random) -> Item:
        if total > 0 and rng.random() < 0.5:
            b = rng.randint(1, min(total, 9))
            q = rng.choice([f"and minus {b} ?", f"now take away {b} ."])
            right, wrong = total - b, _off_by_one(rng, total - b)
            return Item(q, f"{total} minus {b} is {right} .", str(right), f"{total} minus {b} is {wrong} .")
        b = rng.randint(1, 9)
        q = rng.choice([f"and plus {b} ?", f"now add {b} more ."])
        right, wrong = total + b, _off_by_one(rng, total + b)
        return Item(q, f"{total} plus {b} is {right} .", str(right), f"{total} plus {b} is {wrong} .")

    return follow


def _fruit(rng: random.Random, fruit: str | None = None, follow_up: bool = False) -> Item:
    fruit = fruit or rng.choice(sorted(FRUIT_COLOURS))
    colour = FRUIT_COLOURS[fruit]
    wrong = rng.choice(sorted({c for c in FRUIT_COLOURS.values() if c != colour}))
    if follow_up:
        q = rng.choice([f"and {_a(fruit)} ?", f"what about {_a(fruit)} ?"])
    else:
        q = rng.choice([f"what colour is {_a(fruit)} ?", f"what is the colour of {_a(fruit)} ?"])
    other = rng.choice(sorted(f for f in FRUIT_COLOURS if f != fruit))
    return Item(q, f"{_a(fruit)} is {colour} .", colour, f"{_a(fruit)} is {wrong} .", _same_kind(_fruit, other))


def _capital(rng: random.Random, country: str | None = None, follow_up: bool = False) -> Item:
    country = country or rng.choice(sorted(CAPITALS))
    city = CAPITALS[country]
    wrong = rng.choice(sorted(c for c in CAPITALS.values() if c != city))
    if follow_up:
        q = rng.choice([f"and of {country} ?", f"what about {country} ?"])
    else:
        q = rng.choice([f"what is the capital of {country} ?", f"which city is the capital of {country} ?"])
    other = rng.choice(sorted(c for c in CAPITALS if c != country))
    return Item(
        q,
        f"the capital of {country} is {city} .",
        city,
        f"the capital of {country} is {wrong} .",
        _same_kind(_capital, other),
    )


def _sound(rng: random.Random, animal: str | None = None, follow_up: bool = False) -> Item:
    animal = animal or rng.choice(sorted(ANIMAL_SOUNDS))
    sound = ANIMAL_SOUNDS[animal]
    wrong = rng.choice(sorted(s for s in ANIMAL_SOUNDS.values() if s != sound))
    if follow_up:
        q = rng.choice([f"and {_a(animal)} ?", f"what about {_a(animal)} ?"])
    else:
        q = rng.choice([f"what does {_a(animal)} say ?", f"what sound does {_a(animal)} make ?"])
    other = rng.choice(sorted(a for a in ANIMAL_SOUNDS if a != animal))
    return Item(q, f"{_a(animal)} says {sound} .", sound, f"{_a(animal)} says {wrong} .", _same_kind(_sound, other))


def _legs(rng: random.Random, animal: str | None = None, follow_up: bool = False) -> Item:
    animal = animal or rng.choice(sorted(LEGS))
    n = LEGS[animal]
    wrong = n + 2 if n == 0 or rng.random() < 0.5 else n - 2
    if follow_up:
        q = rng.choice([f"and {_a(animal)} ?", f"what about {_a(animal)} ?"])
    else:
        q = f"how many legs does {_a(animal)} have ?"
    other = rng.choice(sorted(a for a in LEGS if a != animal))
    return Item(
        q, f"{_a(animal)} has {n} legs .", str(n), f"{_a(animal)} has {wrong} legs .", _same_kind(_legs, other)
    )


def _same_kind(make: Callable[..., Item], key: str) -> Callable[[random.Random], Item]:
    return lambda rng: make(rng, key, follow_up=True)


def _unit(rng: random.Random) -> Item:
    big, small, n = rng.choice(UNITS)
    wrong = rng.choice([n + 1, n - 1, *(m for _, _, m in UNITS if m != n)])
    q = rng.choice([f"how many {small} are in {_a(big)} ?", f"how many {small} make {_a(big)} ?"])
    return Item(q, f"{_a(big)} has {n} {small} .", str(n), f"{_a(big)} has {wrong} {small} .")


def _count(rng: random.Random) -> Item:
    start = rng.randint(1, 9)
    end = start + rng.randint(2, 5)
    numbers = [str(i) for i in range(start, end + 1)]
    q = rng.choice([f"count from {start} to {end} .", f"please count from {start} up to {end} ."])
    skipped = numbers[:]
    del skipped[rng.randint(1, len(numbers) - 2)]
    wrong = rng.choice([skipped, numbers[:-1], numbers + [str(end + 1)]])
    return Item(q, " ".join(numbers) + " .", " ".join(numbers), " ".join(wrong) + " .")


def _list_task(rng: random.Random) -> Item:
    words = rng.sample(LIST_WORDS, rng.randint(3, 4))
    listed = " ".join(words)
    if rng.random() < 0.5:
        q = rng.choice([f"reverse this list : {listed}", f"say these words backwards : {listed}"])
        right, wrong = words[::-1], rng.choice([words, words[1:] + words[:1]])
    else:
        q = rng.choice([f"repeat this list : {listed}", f"say these words again : {listed}"])
        right, wrong = words, rng.choice([words[::-1], words[:-1]])
    return Item(q, " ".join(right) + " .", " ".join(right), " ".join(wrong) + " .")


def _arithmetic(rng: random.Random) -> Item:
    return _add(rng) if rng.random() < 0.6 else _subtract(rng)


GENERATORS: list[Callable[[random.Random], Item]] = [
    _arithmetic,
    _arithmetic,
    _fruit,
    _capital,
    _sound,
    _legs,
    _unit,
    _count,
    _list_task,
]

SYSTEMS: list[tuple[str, Callable[[Item], str]]] = [  # (system message, how it changes the answer)
    ("you are a helpful assistant .", lambda item: item.answer),
    ("you are a pirate . start every answer with arr .", lambda item: f"arr , {item.answer}"),
    ("answer with just the answer .", lambda item: item.short),
    ("you are polite . end every answer with thank you .", lambda item: f"{item.answer} thank you ."),
]


def _item(rng: random.Random) -> Item:
    return rng.choice(GENERATORS)(rng)


def _turns(rng: random.Random, n: int) -> list[Item]:
    """``n`` questions; a later one follows up on the previous answer where the previous item allows it."""
    items = [_item(rng)]
    while len(items) < n:
        previous = items[-1]
        items.append(previous.follow(rng) if previous.follow and rng.random() < 0.6 else _item(rng))
    return items


def _tool_conversation(rng: random.Random) -> list[dict]:
    """User asks, the assistant calls a tool, the tool answers, the assistant answers from the tool's result."""
    if rng.random() < 0.5:
        a, b = rng.randint(11, 49), rng.randint(2, 9)
        user = rng.choice([f"what is {a} times {b} ?", f"please multiply {a} by {b} ."])
        call, result, answer = f"call calculator : {a} times {b}", str(a * b), f"{a} times {b} is {a * b} ."
    else:
        city, weather, degrees = rng.choice(sorted(CAPITALS.values())), rng.choice(WEATHER), rng.randint(-5, 30)
        user = rng.choice([f"what is the weather in {city} ?", f"how is the weather in {city} today ?"])
        call, result = f"call weather : {city}", f"{weather} , {degrees} degrees"
        answer = f"in {city} it is {weather} and {degrees} degrees ."
    messages = [
        {"role": "user", "content": user},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": answer},
    ]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": "you can call the tools calculator and weather ."})
    return messages


def _conversation(rng: random.Random) -> dict:
    kind = rng.random()
    if kind < 0.06:
        return {"messages": _tool_conversation(rng)}
    items = _turns(rng, 1 if kind < 0.6 else rng.choice([2, 2, 3]))
    messages: list[dict] = []
    respond: Callable[[Item], str] = SYSTEMS[0][1]
    if rng.random() < 0.25:
        system, respond = rng.choice(SYSTEMS)
        messages.append({"role": "system", "content": system})
    for item in items:
        messages.append({"role": "user", "content": item.question})
        messages.append({"role": "assistant", "content": respond(item)})
    if len(items) == 2 and rng.random() < 0.25:
        messages.append({"role": "user", "content": rng.choice(["thank you !", "thanks !"])})
        messages.append({"role": "assistant", "content": rng.choice(["you are welcome .", "happy to help ."])})
    return {"messages": messages}


def _preference(rng: random.Random) -> dict:
    item = _item(rng)
    return {
        "prompt": [{"role": "user", "content": item.question}],
        "chosen": [{"role": "assistant", "content": item.answer}],
        "rejected": [{"role": "assistant", "content": item.wrong}],
    }


def conversation_words(messages: list[dict]) -> int:
    """Words (as a whitespace-and-punctuation word-level tokenizer splits them) plus four markers per message."""
    return sum(len(re.findall(r"\w+|[^\w\s]+", m["content"])) + 4 for m in messages)


def _distinct(n: int, seed: int, make: Callable[[random.Random], dict], key: Callable[[dict], str]) -> list[dict]:
    """Draw rows until ``n`` distinct keys exist, so no eval row repeats a train row."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    for _ in range(100 * n):
        row = make(rng)
        k = key(row)
        if k not in seen:
            seen.add(k)
            rows.append(row)
            if len(rows) == n:
                return rows
    raise RuntimeError(f"the generators yield fewer than {n} distinct rows")


def chat_rows(n: int = CHAT_SIZE, seed: int = 2) -> list[dict]:
    """``n`` distinct conversations."""
    return _distinct(n, seed, _conversation, lambda row: json.dumps(row["messages"]))


def preference_rows(n: int = PREFERENCES_SIZE, seed: int = 3) -> list[dict]:
    """``n`` preference rows with distinct prompts."""
    return _distinct(n, seed, _preference, lambda row: row["prompt"][0]["content"])


def write_all(out_dir: Path) -> list[Path]:
    """Write both chat data files into ``out_dir`` and return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / CHAT_FILE, out_dir / PREFERENCES_FILE]
    write_jsonl(chat_rows(), paths[0])
    write_jsonl(preference_rows(), paths[1])
    return paths


def stale_files(shipped_dir: Path, scratch_dir: Path) -> list[Path]:
    """The shipped files in ``shipped_dir`` that differ from a fresh generation written into ``scratch_dir``."""
    return [
        shipped_dir / p.name
        for p in write_all(scratch_dir)
        if not (shipped_dir / p.name).is_file() or (shipped_dir / p.name).read_bytes() != p.read_bytes()
    ]


def main(argv: list[str] | None = None) -> int:
    """Command line: regenerate the chat data files, or check the shipped ones."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="directory to write into")
    parser.add_argument("--check", action="store_true", help="exit 1 if the files in --out differ from a generation")
    args = parser.parse_args(argv)
    if args.check:
        import tempfile

        with tempfile.TemporaryDirectory() as scratch:
            stale = stale_files(args.out, Path(scratch))
        for path in stale:
            print(f"{path} differs from its generator; run python -m trainer_ext.job.builtin_data.make_chat_data")
        return 1 if stale else 0
    for path in write_all(args.out):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
