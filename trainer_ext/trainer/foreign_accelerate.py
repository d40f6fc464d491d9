"""accelerate's own state, made to agree with our engine when a library the script uses has imported accelerate.

TRL calls accelerate's free functions directly (``accelerate.utils.gather``, ``gather_object``,
``broadcast_object_list``, ``set_seed(device_specific=True)``, ``accelerate.logging.get_logger``). They read
accelerate's global ``PartialState``/``AcceleratorState``, which nothing sets up when our engine replaces
``Accelerator``: they would see one process (rank 1 gathers nothing) or refuse to run. When accelerate is already
loaded in this process (trainer_ext never imports it), an ``accelerate.Accelerator`` is made once over the process
group our state already started, so those functions see the same processes, ranks and device as the engine. A
``PartialState`` that a library made earlier and that counts other processes than ours is reset first.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

import torch

logger = logging.getLogger(__name__)


def accelerate_state_set_up() -> bool:
    """Whether accelerate is loaded and its global ``PartialState`` set up (by a script, a library, or us)."""
    states = sys.modules.get("accelerate.state")
    return bool(getattr(getattr(states, "PartialState", None), "_shared_state", None))


def align_accelerate_state(engine: Any) -> bool:
    """Set up accelerate's global state from ``engine``'s when accelerate is loaded and its state is not set up yet;
    True when it was set up here. Our engine keeps doing the work: accelerate's object is only read."""
    accelerate = sys.modules.get("accelerate")
    states = sys.modules.get("accelerate.state")
    if accelerate is None or states is None or not hasattr(accelerate, "Accelerator"):
        return False
    partial = states.PartialState._shared_state if accelerate_state_set_up() else {}
    if partial and partial.get("num_processes") != engine.num_processes:
        # set up before our engine and wrongly: TRL asks PartialState() for the device while it loads the model, and
        # on a CPU launch without --use_cpu accelerate then sees one process; start again from ours
        states.AcceleratorState._reset_state(reset_partial_state=True)
    elif getattr(states.AcceleratorState, "_shared_state", None):
        return False  # a script's own Accelerator, or an earlier call, set it up
    threads = torch.get_num_threads()  # accelerate picks its own count on CPU when OMP_NUM_THREADS is unset
    cpu = engine.device.type == "cpu"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                accelerate.Accelerator(cpu=cpu, mixed_precision=engine.mixed_precision)
            except (ValueError, TypeError):  # a precision accelerate refuses on this device: ours still applies it
                accelerate.Accelerator(cpu=cpu, mixed_precision="no")
    except Exception as error:  # never stop a run over it: say what the library's own helpers will see
        logger.warning(
            "accelerate is loaded but its state could not be set up from trainer_ext's (%s): accelerate's own "
            "helpers called by a library (gather, set_seed) may see a single process",
            error,
        )
        return False
    finally:
        torch.set_num_threads(threads)
    return True
