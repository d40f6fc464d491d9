"""One process on one device: the base strategy under its registry name."""

from __future__ import annotations

from .base import Strategy


class SingleDeviceStrategy(Strategy):
    """No wrapping, no communication."""

    name = "single"
