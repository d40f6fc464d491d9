"""What one implementation's fork server imports once (``run --batch``): every rank of every phase is forked
from it, without paying the interpreter's start and these imports again.

The server's environment names the implementation (``ACCELERATOR_PARITY_IMPL``). For ``ours`` accelerate is hidden
before anything imports, and the worker's settings are made first, so that transformers' import-time look-ups
(whether accelerate is installed, its verbosity) see what a started worker sees.
"""

import os

from tests.parity_harness.workload import set_up

IMPL = os.environ["ACCELERATOR_PARITY_IMPL"]
set_up(IMPL)

import safetensors.torch  # noqa: E402, F401
import torch  # noqa: E402, F401
import transformers  # noqa: E402

from tests.accelerator_parity import (  # noqa: E402, F401
    scenarios_data,
    scenarios_deepspeed,
    scenarios_fsdp,
    scenarios_misc,
    scenarios_train,
)

transformers.LlamaForCausalLM  # noqa: B018  (transformers imports its modules on first use)
if IMPL == "ours":
    import trainer_ext

    trainer_ext.Accelerator  # noqa: B018
else:
    import accelerate  # noqa: F401
    import accelerate.local_sgd  # noqa: F401
    import accelerate.logging  # noqa: F401
    import accelerate.utils  # noqa: F401
