"""The Trainer a job builds, and the checks that make a bad flag fail before anything is written to output_dir."""

from __future__ import annotations

from typing import Any

import transformers

from trainer_ext.errors import ConfigError


def make_trainer(cls: type[transformers.Trainer], **kwargs: Any) -> transformers.Trainer:
    """``cls(**kwargs)``, a refusal of the user's settings (a tracker not installed, a bad flag) as one ConfigError."""
    try:
        return cls(**kwargs)
    except (ImportError, ValueError) as error:  # e.g. --report_to naming a tracker that is not installed
        raise ConfigError(" ".join(str(error).split())) from error
    except RuntimeError as error:
        if "install" not in str(error):
            raise
        raise ConfigError(f"{' '.join(str(error).split())} (or drop the flag that needs it)") from error


def preflight(trainer: transformers.Trainer) -> None:
    """Build what training builds late (optimizer, a throwaway scheduler, the loaders) so that a bad
    --optim, --lr_scheduler_kwargs or eval setting fails now, before anything is written."""
    import torch

    try:
        trainer.create_optimizer()
        probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=trainer.args.learning_rate or 1.0)
        transformers.get_scheduler(
            trainer.args.lr_scheduler_type,
            probe,
            num_warmup_steps=0,
            num_training_steps=max(trainer.args.max_steps, 1),
            scheduler_specific_kwargs=trainer.args.lr_scheduler_kwargs or {},
        )
    except (ImportError, ValueError, TypeError, KeyError) as error:
        raise ConfigError(" ".join(str(error).split())) from error
