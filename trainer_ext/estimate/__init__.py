"""Memory estimates for one training job, per rank, checked against measurement (``trainer-ext estimate``).

``shape`` reads a model built on the meta device, ``setup`` the strategy/precision/batch of the job,
``activations`` and ``breakdown`` hold the formulas, ``fit`` searches the largest batch and the fixing flags,
``report`` prints; ``measure`` counts what a real run holds. See docs/estimate.md.
"""

from __future__ import annotations

from trainer_ext.estimate.breakdown import Breakdown, estimate
from trainer_ext.estimate.setup import Setup
from trainer_ext.estimate.shape import ModelShape

__all__ = ["Breakdown", "ModelShape", "Setup", "estimate"]
