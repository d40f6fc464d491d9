"""``trainer-ext launch``: run a script, a module or ``train`` on 1..N processes and 1..M machines.

Several processes go through ``torch.distributed.run`` (called as a library), and so does one process
with ``--max_restarts`` (torchrun's agent restarts it; the rendezvous stays on loopback) or one that runs FSDP
(its device mesh needs a process group, of one); one process otherwise is started directly, with no rendezvous
and no torch.distributed variables. ``--dry_run`` shows
the settings with their sources and the DeepSpeed config or FSDP settings as ``train`` will resolve them.

The modules import in one direction, each only from those below it:

    command      prepare / run_launch: the subcommand
    options      the launcher's command line          run       start the processes (torchrun)
    plan         the command, environment, dry run    ports     is the rendezvous port free?
    auto         train --parallelism auto: the layout trainer-ext plan ranks first, as train flags
    fsdp         FSDP settings as train will parse them
    train_args   launch settings into train flags or script variables; the DeepSpeed preview
    settings     command line > config file > defaults, with sources and problems
    config_file  launch config files (ours and accelerate's keys)
    target       what to run
    swap         run in each process by --swap_trainer: our Trainer classes in transformers', then the script
"""

from __future__ import annotations

from trainer_ext.cli.launch.command import prepare, run_launch
from trainer_ext.cli.launch.options import build_parser, split_argv
from trainer_ext.cli.launch.plan import Plan, build_plan, describe
from trainer_ext.cli.launch.run import execute
from trainer_ext.cli.launch.target import Target

__all__ = [
    "Plan",
    "Target",
    "build_parser",
    "build_plan",
    "describe",
    "execute",
    "prepare",
    "run_launch",
    "split_argv",
]
