"""The small data files that ship with the package, so the default job needs no network."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
SENTIMENT = DATA_DIR / "sentiment.jsonl"
CORPUS = DATA_DIR / "corpus.jsonl"
CHAT = DATA_DIR / "chat.jsonl"
PREFERENCES = DATA_DIR / "preferences.jsonl"

__all__ = ["CHAT", "CORPUS", "DATA_DIR", "PREFERENCES", "SENTIMENT"]
