"""One process on one device: the base strategy under its registry name."""

from __future__ import annotations

from trainer_ext.distributed.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """No wrapping, no communication."""

    name = "single"
    max_processes = 1
    too_many_processes = "strategy 'single' cannot run on {world_size} processes; use 'ddp' or launch one process"
