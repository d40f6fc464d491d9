"""The environment variables ``trainer-ext launch`` exports to the processes it starts, named once.

The launcher writes them (``trainer_ext.cli.launch``); the code inside the processes reads ours back
(:class:`trainer_ext.Accelerator`; transformers' TrainingArguments reads ``ACCELERATE_MIXED_PRECISION`` into
``args.mixed_precision``). The topology variables torchrun sets (RANK, WORLD_SIZE, ...) belong to torchrun: named
here too, read in ``trainer_ext.distributed.state``.
"""

from __future__ import annotations

# ours, for a user's script or module (``train`` gets flags instead)
MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"  # accelerate's name, so transformers' TrainingArguments reads it
GRADIENT_ACCUMULATION_STEPS = "TRAINER_EXT_GRADIENT_ACCUMULATION_STEPS"
# the launch's DeepSpeed config (a path or the JSON itself), taken by a script's TrainingArguments and Accelerator that
# name none themselves, as accelerate's `launch --use_deepspeed` makes them (ACCELERATE_USE_DEEPSPEED)
DEEPSPEED_CONFIG = "TRAINER_EXT_DEEPSPEED_CONFIG"
# the launch's FSDP2 settings (JSON of trainer_ext's FSDP keys), taken by a script's TrainingArguments and Accelerator that
# name no FSDP or DeepSpeed settings of their own, as accelerate's `launch --use_fsdp` makes them (ACCELERATE_USE_FSDP)
FSDP_CONFIG = "TRAINER_EXT_FSDP_CONFIG"
# the level of trainer_ext.get_logger's loggers when none is given (accelerate's name, read as accelerate reads it)
LOG_LEVEL = "ACCELERATE_LOG_LEVEL"
# the launch's N-D parallelism: accelerate's switch and its per-dimension sizes (PARALLELISM_CONFIG_TP_SIZE, ...), read
# by a script's TrainingArguments and Accelerator that pass no parallelism_config, as under `accelerate launch`
USE_PARALLELISM_CONFIG = "ACCELERATE_USE_PARALLELISM_CONFIG"
PARALLELISM_CONFIG_PREFIX = "PARALLELISM_CONFIG_"
# the layout `train --parallelism auto` was set to (the start-up block's text), by the trainer-ext CLI (train, or launch
# ... train) once the layout's flags are on the command line; a process that sees it does not resolve it again
PARALLELISM_AUTO = "TRAINER_EXT_PARALLELISM_AUTO"
# where the launcher looks for its config file when --config_file is not given
CONFIG_FILE = "TRAINER_EXT_CONFIG_FILE"

# torch's, set by the launcher when asked for
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
TORCH_DISTRIBUTED_DEBUG = "TORCH_DISTRIBUTED_DEBUG"
TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# torchrun's: the process topology and the rendezvous address
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"  # the node's rank
NODE_RANK = "NODE_RANK"  # the node's rank as other launchers name it (read when GROUP_RANK is absent)
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
# removed from a single process started directly (it must not join another job's group)
TORCHRUN_VARS = (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT)
