"""What one implementation's fork server imports once (``batch.py``): every rank of every launch is forked from it.

The server's environment names the implementation (``EXAMPLES_IMPL``). For ``ours`` accelerate is hidden before
anything imports, as in the runner, so that transformers' import-time look-ups see what a started rank sees.
"""

import os

from tests.parity_harness.workload import set_up

IMPL = os.environ["EXAMPLES_IMPL"]
set_up(IMPL)

import importlib.util  # noqa: E402

import datasets  # noqa: E402, F401
import evaluate  # noqa: E402, F401
import psutil  # noqa: E402, F401
import safetensors.torch  # noqa: E402, F401
import torch  # noqa: E402, F401
import torch.distributed.fsdp  # noqa: E402, F401
import transformers  # noqa: E402

for _name in (
    "AutoModelForSequenceClassification",
    "BertForSequenceClassification",
    "BertTokenizer",
    "get_linear_schedule_with_warmup",
):
    getattr(transformers, _name)  # transformers imports its modules on first use

if IMPL == "ours":
    import trainer_ext

    trainer_ext.Accelerator  # noqa: B018
else:
    import accelerate  # noqa: F401
    import accelerate.local_sgd  # noqa: F401
    import accelerate.logging  # noqa: F401
    import accelerate.utils  # noqa: F401

    if importlib.util.find_spec("deepspeed") is not None:
        import deepspeed  # noqa: F401  (accelerate's unwrap_model imports it where it is installed)
