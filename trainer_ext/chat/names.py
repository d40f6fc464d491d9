"""The names the chat flags choose from, in one place that imports nothing (the flags are checked before torch)."""

from __future__ import annotations

FORMATS = ("messages", "prompt-completion", "alpaca", "text", "preference")
TEMPLATE_NAMES = ("chatml", "llama-3", "mistral", "qwen")
TRUNCATIONS = ("turns", "drop", "error", "cut")
LOSS_TYPES = ("sigmoid", "ipo", "simpo")

IGNORE_INDEX = -100
"""The label of a token that is not trained on (prompts, padding, each packed document's first token)."""
