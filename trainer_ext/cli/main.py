"""``trainer-ext``: dispatches subcommands; bad input ends in one ``error:`` line on stderr and exit code 2."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from trainer_ext.distributed import cpu_threads
from trainer_ext.errors import ConfigError, did_you_mean

EXIT_USAGE = 2


@dataclass(frozen=True)
class Command:
    """A subcommand: ``module:function`` taking the remaining argv and returning an exit code (imported lazily)."""

    help: str
    target: str

    def load(self):
        module, function = self.target.split(":")
        return getattr(importlib.import_module(module), function)


# New subcommands (launch, config, env, test) register here; their modules are imported only when run.
COMMANDS: dict[str, Command] = {
    "train": Command(
        "train or fine-tune a model (no arguments: the built-in demo job)", "trainer_ext.cli.main:run_train"
    ),
    "launch": Command(
        "run a script, a module or `train` on several processes or machines", "trainer_ext.cli.launch:run_launch"
    ),
    "config": Command(
        "write a launch config (questionnaire, --default) or check one (validate FILE)",
        "trainer_ext.cli.config:run_config",
    ),
    "env": Command("print versions, devices and the launch config, for bug reports", "trainer_ext.cli.env:run_env"),
    "test": Command(
        "self-test the configured processes: collectives and a few training steps", "trainer_ext.cli.selftest:run_test"
    ),
    "report": Command(
        "plot runs: curves and a summary as PNGs and one HTML page", "trainer_ext.cli.report:run_report"
    ),
    "estimate": Command(
        "per-rank memory of a train job before it runs (--measure: checked by two real steps)",
        "trainer_ext.cli.estimate:run_estimate",
    ),
    "plan": Command(
        "rank the parallel layouts of a train job on given machines (--verify: checked by two real steps)",
        "trainer_ext.cli.plan:run_plan",
    ),
    "checkpoint": Command(
        "check a checkpoint against its marker (verify DIR), or commit files changed on purpose (seal DIR)",
        "trainer_ext.cli.checkpoint:run_checkpoint",
    ),
}


def _build_train_parser():
    from trainer_ext.job.flags import build_parser  # torch and transformers: only when the flag spec is not current

    return build_parser()


def check_train_flags(argv: Sequence[str]) -> dict:
    """Flags, their values, the ``--config`` files' keys, and the model and data fields (paths, presets, task)
    checked before torch is imported; ConfigError on the first problem. What needs the real types or the model is
    left to the full parse. Returns the values given (the files', then the flags')."""
    from trainer_ext.config_files import load_mapping
    from trainer_ext.job.fields import DataArguments, ModelArguments
    from trainer_ext.job.flag_spec import CONFIG_SUFFIXES, check_argv, load_spec
    from trainer_ext.values import normalize_keys

    flags = load_spec(_build_train_parser)
    given = check_argv(argv, flags)
    keys = [flag.dest for flag in flags if flag.dest != "config"]  # a config file names no other config file
    values: dict = {}
    for path in given.pop("config", []):
        loaded = load_mapping(path, "--config", suffixes=CONFIG_SUFFIXES)
        values.update(normalize_keys(loaded, keys, f"config file {path!r}"))
    values.update(given)
    for fields, check in ((ModelArguments, "validate_model"), (DataArguments, "validate_data")):
        names = fields.__dataclass_fields__
        try:
            getattr(fields(**{k: v for k, v in values.items() if k in names}), check)()
        except ConfigError:
            raise
        except (TypeError, ValueError, AttributeError):
            pass  # a value of another shape (a config file's string for a number): the full parse words it
    return values


def run_train(argv: Sequence[str]) -> int:
    """``trainer-ext train``: flags and config files checked before the heavy imports, the CPU thread policy set,
    then the job run; prints where the model went."""
    from trainer_ext.job.flag_help import HELP_ALL

    # first: a stale flag spec below is rebuilt by the real parser, which imports torch
    cpu_threads.apply_to_environment(cpu_threads.local_processes())
    if any(word in ("-h", "--help", HELP_ALL) for word in argv):
        from trainer_ext.job.flag_help import render
        from trainer_ext.job.flag_spec import load_spec

        print(render(load_spec(_build_train_parser), everything=HELP_ALL in argv), end="")
        return 0
    values = check_train_flags(argv)
    argv = _resolve_parallelism(argv, values)

    from trainer_ext.job.flags import parse_train_args
    from trainer_ext.job.run import train

    args = parse_train_args(argv)
    is_main = args.process_index == 0
    logging.basicConfig(
        format="%(levelname)s %(name)s: %(message)s", level=logging.INFO if is_main else logging.WARNING
    )
    train(args)
    if is_main:
        saved = "LoRA adapter and tokenizer" if args.lora_r else "model, tokenizer and config"
        merged = f" (merged model: {args.output_dir}/merged)" if args.merge_lora else ""
        print(f"{saved} saved to {args.output_dir}{merged}")
    return 0


def _resolve_parallelism(argv: Sequence[str], values: dict) -> Sequence[str]:
    """``--parallelism auto`` resolved to the plan's layout for the processes this one runs among (under torchrun
    every rank resolves it alike; a launcher that resolved it already says so in the environment)."""
    import os

    from trainer_ext import env_vars
    from trainer_ext.cli import parallelism

    if not parallelism.requested(values) or parallelism.already_resolved():
        return argv
    world = int(os.environ.get(env_vars.WORLD_SIZE) or 1)
    per_machine = int(os.environ.get(env_vars.LOCAL_WORLD_SIZE) or world)
    cpu = parallelism.truthy(values.get("use_cpu"))
    cluster = parallelism.cluster_for(max(world // per_machine, 1), per_machine, cpu, values.get("device_memory"))
    resolved = parallelism.resolve(argv, cluster, "trainer-ext launch --nproc_per_node")
    os.environ.update(parallelism.auto_env(resolved))
    return resolved.argv


def _usage() -> str:
    lines = ["usage: trainer-ext <command> [flags]", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}} {command.help}" for name, command in COMMANDS.items()]
    lines += ["", "Run 'trainer-ext <command> --help' for the flags of a command."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``trainer-ext`` and ``python -m trainer_ext``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_USAGE
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(f"error: unknown command {name!r}.{did_you_mean(name, COMMANDS)}\n\n{_usage()}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return command.load()(rest)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exit_:  # --help prints and exits 0
        return exit_.code if isinstance(exit_.code, int) else 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
