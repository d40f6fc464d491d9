"""``trainer-ext test``: the self-test, started through the launcher on the configured processes.

Takes the launch options (``--num_processes 2``, ``--config_file …``; see ``trainer-ext launch --help``)
plus ``--timeout SECONDS`` (default 30): how long a collective may wait for a rank before the test
fails and names the ranks that never arrived. DeepSpeed/FSDP settings are ignored: the test checks the
processes, the network and plain data parallelism.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from trainer_ext.cli.launch import describe, execute, prepare
from trainer_ext.errors import ConfigError

WORKER = "trainer_ext.cli.selftest_worker"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ConfigError(f"test: {message.removeprefix('argument ')}")


def _seconds(text: str) -> float:
    """``--timeout``: a positive number of seconds, else a one-line error saying so."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs a number of seconds, e.g. 30 (got {text!r})") from None
    if not seconds > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {text!r})")
    return seconds


def run_test(argv: Sequence[str]) -> int:
    """Launch the self-test worker on every process; exit code 0 when every check passed."""
    parser = _Parser(prog="trainer-ext test", add_help=False, allow_abbrev=False)
    parser.add_argument("--timeout", type=_seconds, default=30.0)
    parser.add_argument("--simulate_hang", "--simulate-hang", type=int, default=None)
    if any(word in ("-h", "--help") for word in argv):
        print(f"usage: trainer-ext test [launch options] [--timeout SECONDS]\n\n{__doc__}")
        return 0
    own, launch_options = parser.parse_known_args(list(argv))
    stray = [word for word in launch_options if word in ("train", "-m", "--module") or word.endswith(".py")]
    if stray:
        raise ConfigError(f"test: takes launch options only, not a target ({stray[0]!r})")
    worker = ["-m", WORKER, "--timeout", f"{own.timeout:g}"]
    if own.simulate_hang is not None:
        worker += ["--simulate_hang", str(own.simulate_hang)]
    settings, plan, dry_run = prepare([*launch_options, *worker], strategy=False)
    if dry_run:
        print(describe(settings, plan))
        return 0
    for note in settings.notes + plan.notes:
        print(f"trainer-ext test: note: {note}", file=sys.stderr)
    code = execute(plan)
    if code != 0:
        print(f"self-test FAILED (exit code {code}); see the FAIL lines and diagnosis above", file=sys.stderr)
        return 1
    return 0
