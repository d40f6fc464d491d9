"""What the fork server of :mod:`tests.helpers.forked_ranks` imports once, for every rank it forks.

The heavy imports of the rank jobs: torch's distributed packages, transformers' Trainer and the tiny models'
classes, datasets, safetensors and trainer_ext's engine. Nothing here runs anything: a forked rank starts from
exactly what a fresh interpreter has after these imports.
"""

import datasets  # noqa: F401
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import transformers

import trainer_ext
import trainer_ext.distributed.engine  # noqa: F401

for _name in ("Trainer", "TrainingArguments", "LlamaForCausalLM", "LlamaForSequenceClassification", "GPT2LMHeadModel"):
    getattr(transformers, _name)  # transformers imports its modules on first use
for _name in ("Trainer", "TrainingArguments", "Accelerator"):
    getattr(trainer_ext, _name)
