"""Importing DeepSpeed and joining its communication to our process group (the strategy calls these when used).

DeepSpeed picks its accelerator at import and reads the local rank from the environment only; a process without a
launcher still needs a (one-rank) process group for it.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

import torch

from trainer_ext.distributed.state import DistState, destroy_process_group, release_groups_after_destroy
from trainer_ext.env_vars import LOCAL_RANK
from trainer_ext.errors import ConfigError

INSTALL_HINT = (
    "DeepSpeed is not installed: pip install 'deepspeed>=0.16' "
    "(on a machine without CUDA: DS_BUILD_OPS=0 pip install 'deepspeed>=0.16')"
)


def release_group_references() -> None:
    """Let go of every group DeepSpeed's module globals still refer to, as its own destroy does (when it ran)."""
    groups = sys.modules.get("deepspeed.utils.groups")  # imported only where DeepSpeed ran
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(group=None)


release_groups_after_destroy(release_group_references)


def import_deepspeed() -> Any:
    """``import deepspeed``, or a ConfigError saying which extra to install."""
    try:
        import deepspeed
    except ImportError as exc:
        raise ConfigError(f"{INSTALL_HINT} ({exc})") from None
    return deepspeed


def is_engine(model: Any) -> bool:
    """True for a ``DeepSpeedEngine`` (without importing deepspeed when nothing did yet).

    A folder named ``deepspeed`` on ``sys.path`` can stand in as a namespace package where deepspeed is not
    installed: it has no engine class, so nothing is an engine.
    """
    engine_cls = getattr(sys.modules.get("deepspeed"), "DeepSpeedEngine", None)
    return engine_cls is not None and isinstance(model, engine_cls)


def start_communication(state: DistState, build_cpu_shm_comm: bool = False) -> tuple[Any, bool]:
    """Import deepspeed and set up its communication on our process group (idempotent).

    Returns the module and whether this call created a one-rank process group (its creator destroys it).
    """
    if state.device.type == "cpu":
        # as TrainingArguments does (for models built before any engine): DeepSpeed picks its device at import
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = import_deepspeed()
    accelerator = deepspeed.get_accelerator().device_name()
    if state.device.type != accelerator:
        raise ConfigError(
            f"DeepSpeed picked the {accelerator!r} accelerator but this process trains on "
            f"{state.device.type!r}; set DS_ACCELERATOR={state.device.type} before starting"
        )
    # DeepSpeed (engine, zero.Init) reads the local rank from the environment only; srun and a plain
    # `python train.py` do not set it, so hand it ours (the launcher's value when there is one)
    local_rank = str(state.local_process_index)
    if os.environ.setdefault(LOCAL_RANK, local_rank) != local_rank:
        raise ConfigError(
            f"{LOCAL_RANK}={os.environ[LOCAL_RANK]} in the environment but this process is local rank {local_rank}"
        )
    if deepspeed.comm.is_initialized():
        return deepspeed, False
    if accelerator == "cpu" and not build_cpu_shm_comm:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op when it first sets up
        # communication (~1 min of g++); training never uses it (only AutoTP inference does, and falls
        # back to torch.distributed without it). DeepSpeed keeps this probe dict editable for that purpose.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    created_group = False
    if not torch.distributed.is_initialized():
        # one process without a launcher: DeepSpeed still wants a process group; an in-memory
        # one-rank group needs no address or port
        torch.distributed.init_process_group(state.backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
        created_group = True
        atexit.register(destroy_own_group)  # gloo threads alive at interpreter teardown abort the process
    # with a group already there, DeepSpeed wraps it instead of creating one
    deepspeed.comm.init_distributed(dist_backend=state.backend, dist_init_required=False)
    return deepspeed, created_group


def destroy_own_group() -> None:
    """Destroy the one-rank group start_communication made (at exit, or when the strategy is destroyed)."""
    if torch.distributed.is_initialized():
        destroy_process_group()
