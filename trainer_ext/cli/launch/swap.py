"""``python -m trainer_ext.cli.launch.swap (SCRIPT.py | -m MODULE) [args...]``: an unmodified transformers script on
our engine; ``trainer-ext launch --swap_trainer`` starts every process through it.

It puts ``trainer_ext.Trainer`` and ``trainer_ext.TrainingArguments`` where scripts find transformers' own
(``transformers.Trainer``, ``transformers.trainer.Trainer``, ``transformers.TrainingArguments``,
``transformers.training_args.TrainingArguments``), then runs the script as ``__main__`` with the ``sys.argv`` and
``sys.path[0]`` that ``python SCRIPT.py`` gives it. Classes derived from transformers' after the swap (its
``Seq2SeqTrainer`` and ``Seq2SeqTrainingArguments``, a library's first imported by the script) are built on ours.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from trainer_ext.cli.launch.target import Target, target_problems

USAGE = "python -m trainer_ext.cli.launch.swap (SCRIPT.py | -m MODULE) [args...]"
# the folder holding the trainer_ext package: kept on sys.path where trainer_ext is not installed
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def swap_in() -> None:
    """Make transformers' public ``Trainer`` and ``TrainingArguments`` names ours, before the script imports them."""
    import transformers
    import transformers.trainer
    import transformers.training_args

    from trainer_ext.trainer.trainer import Trainer
    from trainer_ext.trainer.training_args import TrainingArguments

    for module in (transformers, transformers.trainer):
        module.Trainer = Trainer
    for module in (transformers, transformers.training_args):
        module.TrainingArguments = TrainingArguments
    # transformers' seq2seq modules are not imported yet (nothing of ours imports them): when the script imports
    # them, their classes subclass the names above


def parse(argv: Sequence[str]) -> Target:
    """``SCRIPT.py args`` or ``-m MODULE args`` as a target; SystemExit(2) with one ``error:`` line when unusable."""
    if len(argv) > 1 and argv[0] in ("-m", "--module"):
        target = Target("module", argv[1], list(argv[2:]), swap=True)
    elif argv and not argv[0].startswith("-"):
        target = Target("script", argv[0], list(argv[1:]), swap=True)
    else:
        print(f"error: usage: {USAGE}", file=sys.stderr)
        raise SystemExit(2)
    problems = target_problems(target)
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        raise SystemExit(2)
    return target


def run(target: Target) -> None:
    """Swap our classes in, then run the target as ``__main__`` the way ``python`` would."""
    swap_in()
    sys.argv = [target.name, *target.args]
    if target.kind == "module":
        runpy.run_module(target.name, run_name="__main__", alter_sys=True)  # argv[0] becomes its file, as `-m` does
        return
    path = os.path.abspath(target.name)
    here, sys.path[0] = sys.path[0], os.path.dirname(path)  # `-m` put the working directory first; a script its folder
    if here == _PACKAGE_ROOT:
        sys.path.append(here)
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    run(parse(sys.argv[1:]))
