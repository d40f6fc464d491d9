"""The implementations a parity case runs under, and which of a set's cases the current pytest run selected."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

STOCK, OURS = "stock", "ours"
IMPLS = (STOCK, OURS)


def selected(request: pytest.FixtureRequest, *params: str) -> list[Any]:
    """The cases of the requesting module's parametrized tests that this run collected (``-k`` applied): one value per
    test where ``params`` is one name, else a tuple of the named parameters' values."""
    cases = []
    for item in request.session.items:
        if item.module is request.module and hasattr(item, "callspec"):
            values = tuple(item.callspec.params[name] for name in params)
            cases.append(values[0] if len(values) == 1 else values)
    return cases


def matching(names: list[str], patterns: list[str]) -> list[str]:
    """The names that contain one of ``patterns`` (every name where there is none): a command line's ``-k``."""
    return [name for name in names if not patterns or any(pattern in name for pattern in patterns)]
