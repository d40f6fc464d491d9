"""User-facing errors: bad input that the CLI reports in one line with exit code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """Bad input from the user: a flag, a file, a column, a device combination.

    The message says what is wrong and how to fix it; the CLI prints it without a traceback.
    """


def closest(name: str, valid: Iterable[str], n: int = 3) -> list[str]:
    """The valid names closest to ``name``, best first (for 'did you mean' hints)."""
    return difflib.get_close_matches(name, list(valid), n=n, cutoff=0.6)


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """A ' Did you mean …?' suffix, or '' when nothing is close."""
    matches = closest(name, valid)
    if not matches:
        return ""
    return " Did you mean " + " or ".join(repr(m) for m in matches) + "?"
