"""A tiny model folder and local datasets that TRL's own scripts (``trl/scripts/*.py``) load unmodified.

    python -m tests.with_trl.script_fixtures DIR

writes ``DIR/model`` (a 2-layer Llama with a word-level tokenizer and a chat template that marks the assistant's
turns, saved as ``from_pretrained`` reads it) and ``DIR/data/<kind>/{train,test}.jsonl`` for each kind of row the
scripts train on: ``text``, ``messages``, ``preference`` (prompt/chosen/rejected), ``unpaired`` (KTO's
prompt/completion/label) and ``prompt`` (GRPO/RLOO). ``--dataset_name DIR/data/<kind>`` is what a script reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.with_trl.trl_job import model, sentence, tokenizer

KINDS = ("text", "messages", "preference", "unpaired", "prompt")


def rows(kind: str, n: int, seed: int) -> list[dict]:
    """``n`` rows of ``kind`` from a seeded generator (the same rows on every run)."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(4, 10, (1,), generator=rng))
        prompt = sentence(rng, length)
        if kind == "text":
            out.append({"text": prompt})
        elif kind == "messages":
            answer = sentence(rng, 3 + length // 2)
            out.append(
                {"messages": [{"role": "user", "content": prompt + " ?"}, {"role": "assistant", "content": answer}]}
            )
        elif kind == "preference":
            out.append({"prompt": prompt, "chosen": "yes good answer", "rejected": sentence(rng, 3)})
        elif kind == "unpaired":
            good = i % 2 == 0
            out.append(
                {"prompt": prompt, "completion": "yes good answer" if good else sentence(rng, 3), "label": good}
            )
        else:
            out.append({"prompt": prompt})
    return out


def write(root: Path) -> Path:
    """The model folder and every dataset under ``root``; returns ``root``."""
    tok = tokenizer()
    net = model("causal", len(tok), tok.pad_token_id)
    net.generation_config.pad_token_id = tok.pad_token_id
    net.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    for k, kind in enumerate(KINDS):
        folder = root / "data" / kind
        folder.mkdir(parents=True, exist_ok=True)
        for split, n, seed in (("train", 32, 10 + k), ("test", 8, 20 + k)):
            text = "".join(json.dumps(row) + "\n" for row in rows(kind, n, seed))
            (folder / f"{split}.jsonl").write_text(text)
    return root


def length_reward(completions: list, **kwargs: object) -> list[float]:
    """A reward for GRPO/RLOO runs: shorter completions (in characters) score higher, so completions of the same
    token count still differ (passed as ``--reward_funcs tests.with_trl.script_fixtures.length_reward``)."""
    texts = [c if isinstance(c, str) else " ".join(m["content"] for m in c) for c in completions]
    return [-float(len(t)) for t in texts]


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
