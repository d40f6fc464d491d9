"""``trainer-ext launch``: parse, resolve and check everything, then print the dry run or start the processes.

Settings come from the command line, then the config file, then defaults (see :mod:`.settings`); everything
that can be checked is checked before a process starts (the DeepSpeed or FSDP config of ``train`` included),
and every problem found is reported at once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from trainer_ext.cli.launch.config_file import find_config_file, read_config_file
from trainer_ext.cli.launch.options import build_parser, given_options, split_argv
from trainer_ext.cli.launch.plan import Plan, build_plan, describe
from trainer_ext.cli.launch.ports import port_problems
from trainer_ext.cli.launch.run import execute
from trainer_ext.cli.launch.settings import Settings, resolve
from trainer_ext.cli.launch.target import target_problems
from trainer_ext.errors import ConfigError


def prepare(argv: Sequence[str], strategy: bool = True) -> tuple[Settings, Plan, bool]:
    """Parse, resolve and check ``argv`` into (settings, plan, dry_run); ConfigError listing every problem."""
    parser = build_parser()
    options, target = split_argv(argv, parser)
    if "-h" in options or "--help" in options:
        parser.print_help()
        raise SystemExit(0)
    namespace = parser.parse_args(options)
    if target is not None and namespace.swap_trainer:
        target.swap = True
    path, how = find_config_file(namespace.config_file)
    config = read_config_file(path) if path is not None else None
    if config is not None:
        _say(f"launch config: {path} ({how})")
        if config.ignored:
            _say(f"warning: ignored accelerate keys (no effect here): {', '.join(config.ignored)}")
    settings = resolve(given_options(namespace, options, parser), config)
    settings.config_file = f"{path} ({how})" if path is not None else how
    problems = (config.problems if config else []) + settings.problems + target_problems(target)
    if not problems:
        problems += port_problems(settings)
    plan = None
    if not problems:
        try:  # builds the train arguments and resolves their DeepSpeed config: its errors are launch problems too
            plan = build_plan(settings, target, strategy)
        except ConfigError as error:
            problems.append(str(error).replace("\n", "\n    "))
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"cannot launch ({len(problems)} problem{'s' * (len(problems) > 1)}):\n{listed}")
    return settings, plan, namespace.dry_run


def _say(text: str) -> None:
    print(f"trainer-ext launch: {text}", file=sys.stderr, flush=True)


def run_launch(argv: Sequence[str]) -> int:
    """``trainer-ext launch``: print the dry run or start the processes."""
    settings, plan, dry_run = prepare(argv)
    if dry_run:
        print(describe(settings, plan))
        return 0
    for note in settings.notes + plan.notes:
        _say(f"note: {note}")
    machines = settings["num_machines"]
    where = f"{machines} machines ({settings['nproc_per_node']} here)" if machines > 1 else "this machine"
    _say(f"{settings.world_size} process{'es' * (settings.world_size > 1)} on {where}, {settings['device']}")
    return execute(plan)
